#!/bin/sh
# Remove TuneDeck for the current user: the environment, uv, caches, the menu entry and the icon.
# Downloaded models (cache/huggingface) are kept unless --all is given.
set -eu
root="${TUNEDECK_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/tunedeck}"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
rm -f "$data/applications/tunedeck.desktop" "$data/icons/hicolor/256x256/apps/tunedeck.png"
[ "$(readlink -- "$HOME/.local/bin/tunedeck" 2>/dev/null || true)" = "$root/tunedeck" ] && rm -f "$HOME/.local/bin/tunedeck"
rm -rf "$root/env" "$root/env.new" "$root/env.old" "$root/python" "$root/wheels" "$root/logs" \
    "$root/cache/uv" "$root/cache/pip" "$root/cache/torch" "$root/cache/triton" "$root/cache/excludes.txt"
rm -f "$root/uv" "$root/tunedeck" "$root/install.sh" "$root/tunedeck.png" "$root/tunedeck.desktop" \
    "$root/tunedeck-install.json"
[ "${1:-}" = "--all" ] && rm -rf "$root/cache/huggingface"
rm -f "$root/uninstall.sh"
rmdir "$root/cache" "$root" 2>/dev/null || true
echo "TuneDeck was removed from $root"
