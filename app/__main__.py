"""``tunedeck`` and ``python -m app``: the window without arguments, the command line with them.

A subcommand, ``--help`` or ``--version`` goes to :func:`engine.cli.main` without importing Qt, so scripted use
stays light. Otherwise the window opens; Qt's own options (``-platform offscreen``, ``-style``...) are passed on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

CLI_OPTIONS = frozenset({"-h", "--help", "--version"})


def wants_cli(args: Sequence[str]) -> bool:
    """True for a command word (known or not: the CLI explains) or a CLI option; Qt options are anything else."""
    return bool(args) and (args[0] in CLI_OPTIONS or not args[0].startswith("-"))


def has_display(args: Sequence[str] = ()) -> bool:
    """False on a Linux machine without X11 or Wayland (a server, an SSH session), where Qt would abort."""
    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM") or "-platform" in args:
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def main(argv: Sequence[str] | None = None) -> int:
    # first, before anything can start CUDA (the window's hardware detection does, early)
    from engine.hardware.allocator import set_at_process_start

    set_at_process_start()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--gui"]:  # the installed launcher's spelling of "open the window"
        args = args[1:]
    if wants_cli(args) or not has_display(args):
        from engine.cli import main as cli_main

        if not args:
            print("No display found, so no window: here is the command line.\n", file=sys.stderr)
        return cli_main(args)
    prepare_window_process()
    from app.main_window import run_app

    code = run_app([sys.argv[0], *args])
    delete_windows()
    return code


def delete_windows() -> None:
    """Delete the closed main window while the application still lives. Left to the interpreter's exit, PySide
    destroys it after its platform window and the process aborts ("pure virtual method called" in QWidget::destroy,
    2 of 3 quits after a demo run in the offscreen test window)."""
    from PySide6.QtCore import QEvent
    from PySide6.QtWidgets import QApplication, QMainWindow

    app = QApplication.instance()
    if app is None:
        return
    for widget in QApplication.topLevelWidgets():
        if isinstance(widget, QMainWindow):  # its dialogs go with it; Qt's own top-level helpers stay Qt's
            widget.deleteLater()
    app.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)


def prepare_window_process() -> None:
    """Before the window: Triton's LLVM loaded before any OpenGL use can load the system's, which would make the
    first run's thread die in libLLVM (engine.crash_guard), and a crash log in the data folder."""
    from engine.config import data_dir
    from engine.crash_guard import enable_crash_log, preload_compiler_libraries

    preload_compiler_libraries()
    enable_crash_log(data_dir())


if __name__ == "__main__":
    sys.exit(main())
