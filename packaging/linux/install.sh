#!/bin/sh
# Set up TuneDeck for the current user, in ~/.local/share/tunedeck (or $TUNEDECK_HOME).
#
# Copies uv and TuneDeck's wheel there, creates the private Python environment with everything except torch
# (the app installs the torch build that fits the GPU on its first start), and adds a menu entry, an icon and
# ~/.local/bin/tunedeck. A new environment is built beside the old one and replaces it only when complete, so
# running this again repairs a broken installation. With --wheelhouse FOLDER (or a "wheelhouse" folder beside
# this script) everything, torch included, comes from that folder and no network is used.
#
#   ./install.sh [--wheelhouse FOLDER] [--python VERSION_OR_PATH] [--no-menu]
set -eu

here=$(CDPATH='' cd -- "$(dirname -- "$(readlink -f -- "$0")")" && pwd)
root="${TUNEDECK_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/tunedeck}"
python="${TUNEDECK_PYTHON:-3.12}"
wheelhouse=""
menu=1
[ -d "$here/wheelhouse" ] && wheelhouse="$here/wheelhouse"
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) wheelhouse=$(readlink -f -- "$2"); shift 2 ;;
        --python) python="$2"; shift 2 ;;
        --no-menu) menu=0; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

mkdir -p "$root/wheels" "$root/cache" "$root/logs"
if [ "$here" != "$root" ]; then
    for file in uv tunedeck install.sh uninstall.sh tunedeck.png tunedeck.desktop; do
        cp -f "$here/$file" "$root/$file.tmp" && mv -f "$root/$file.tmp" "$root/$file"
    done
    rm -f "$root"/wheels/tunedeck-*.whl
    cp -f "$here"/wheels/tunedeck-*.whl "$root/wheels/"
fi
wheel=$(ls "$root"/wheels/tunedeck-*.whl | tail -n 1)

export UV_CACHE_DIR="$root/cache/uv" UV_PYTHON_INSTALL_DIR="$root/python" UV_NO_CONFIG=1 UV_NO_PROGRESS=1
unset VIRTUAL_ENV
offline=""
if [ -n "$wheelhouse" ]; then
    offline="--offline --no-index --find-links"
    echo "Installing from $wheelhouse, without network"
fi
managed="--managed-python"
case "$python" in */*) managed="" ;; esac

echo "Creating the Python environment in $root/env"
rm -rf "$root/env.new"
# shellcheck disable=SC2086  # $offline and $managed are lists of options
"$root/uv" venv --relocatable $managed --python "$python" ${offline:+--offline} "$root/env.new"
printf 'torch\n' > "$root/cache/excludes.txt"
echo "Installing TuneDeck (everything except torch)"
# shellcheck disable=SC2086
"$root/uv" pip install --python "$root/env.new/bin/python" --excludes "$root/cache/excludes.txt" \
    $offline ${wheelhouse:+"$wheelhouse"} "$wheel"
: > "$root/env.new/.tunedeck-ready"
rm -rf "$root/env.old"
[ -d "$root/env" ] && mv "$root/env" "$root/env.old"
mv "$root/env.new" "$root/env"
rm -rf "$root/env.old"
version=$(basename "$wheel" | cut -d- -f2)
printf '{"version": "%s", "python": "%s"}\n' "$version" "$python" > "$root/tunedeck-install.json"

if [ -n "$wheelhouse" ] && ls "$wheelhouse"/torch-*.whl >/dev/null 2>&1; then
    "$root/env/bin/python" -m engine.setup install-torch --root "$root" --wheelhouse "$wheelhouse"
fi

if [ "$menu" = 1 ]; then
    data="${XDG_DATA_HOME:-$HOME/.local/share}"
    mkdir -p "$HOME/.local/bin" "$data/applications" "$data/icons/hicolor/256x256/apps"
    ln -sf "$root/tunedeck" "$HOME/.local/bin/tunedeck"
    cp -f "$root/tunedeck.png" "$data/icons/hicolor/256x256/apps/tunedeck.png"
    # The menu entry starts this installation's launcher; quoted, so that folders with spaces work.
    sed "s|^Exec=.*|Exec=\"$root/tunedeck\" --gui|; s|^TryExec=.*|TryExec=$root/tunedeck|" \
        "$root/tunedeck.desktop" > "$data/applications/tunedeck.desktop"
fi
echo "TuneDeck is installed in $root. Start it from the menu, or run: tunedeck --gui"
