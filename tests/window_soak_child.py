"""The main window driven through demo runs in a process of its own (tests/test_app_soak.py starts it), so that a
crash is a failed test rather than a dead test session.

It starts the window as ``tunedeck`` does (``--as-app``: what app.__main__ does before the window), optionally loads
the system's LLVM the way Mesa's OpenGL driver does (``--system-llvm``) or makes an OpenGL context current
(``--gl-context``, under an X server), prepares the demo, and then runs cycles:
Start, Pause, every page shown, Resume, Stop, and a chat with the stopped run every ``--chat-every`` cycles. Each
measurement is printed as one JSON line: ``{"cycle": n, "rss": bytes, "width": px, "height": px}`` after each cycle
(the GUI thread's garbage collected first), then ``{"done": true}``. Waits are for conditions, bounded only against
a hang.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hang import HANG_S


def system_llvm() -> str | None:
    """The system's shared LLVM (what Mesa's OpenGL drivers link), the newest found; None where there is none."""
    found: list[str] = []
    for pattern in (
        "/usr/lib/*-linux-gnu/libLLVM*.so.*",
        "/usr/lib64/libLLVM*.so*",
        "/usr/lib/llvm-*/lib/libLLVM*.so*",
    ):
        found += glob.glob(pattern)
    return sorted(found)[-1] if found else None


def wait_until(app: Any, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        app.processEvents()
        time.sleep(0.005)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {HANG_S:.0f} s")


def settle(app: Any, rounds: int = 20) -> None:
    """Let posted events (repaints, layout requests) run, as a user's pause between clicks would."""
    for _ in range(rounds):
        app.processEvents()
        time.sleep(0.005)


def resident_bytes() -> int:
    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--chat-every", type=int, default=0, help="chat after every Nth cycle (0: never)")
    parser.add_argument("--pause", action="store_true", help="pause and resume in each cycle")
    parser.add_argument("--compile", action="store_true", help="fused kernels on (torch.compile on the worker)")
    parser.add_argument("--as-app", action="store_true", help="prepare the process as tunedeck does")
    parser.add_argument("--system-llvm", action="store_true", help="load the system's LLVM as Mesa's GL does")
    parser.add_argument("--gl-context", action="store_true", help="make an OpenGL context current (an X server)")
    parser.add_argument("--folder", type=Path, required=True)
    args = parser.parse_args(argv)
    os.environ["TUNEDECK_HOME"] = str(args.folder / "home")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.as_app:
        from app.__main__ import prepare_window_process
        from engine.hardware.allocator import set_at_process_start

        set_at_process_start()
        prepare_window_process()
    if args.system_llvm:
        llvm = system_llvm()
        assert llvm is not None, "no system LLVM"
        ctypes.CDLL(llvm, mode=os.RTLD_GLOBAL | os.RTLD_NOW)  # Mesa's loader opens its driver RTLD_GLOBAL
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from app.background.gui_gc import collect_on_gui_thread
    from app.main_window import MainWindow

    app = QApplication([sys.argv[0]])
    collect_on_gui_thread(app)
    gl = open_gl_context() if args.gl_context else None  # noqa: F841 (kept current for the whole session)
    window = MainWindow(
        detect_on_show=False, settings=QSettings(str(args.folder / "window.ini"), QSettings.Format.IniFormat)
    )
    window.setup_panel.form.editor("output.dir").setText(str(args.folder / "runs"))
    window.show()
    prepare_demo(app, window, compile_on=args.compile)
    for cycle in range(args.cycles):
        run_dir = one_cycle(app, window, pause=args.pause)
        if args.chat_every and cycle % args.chat_every == 0:
            chat(app, window, run_dir)
        settle(app)
        size = window.size()
        print(json.dumps({"cycle": cycle, "rss": resident_bytes(), "width": size.width(), "height": size.height()}))
        sys.stdout.flush()
    print(json.dumps({"done": True}))
    sys.stdout.flush()
    tear_down(window)
    return 0


def tear_down(window: Any) -> None:
    """End as ``tunedeck`` ends (app.__main__.delete_windows): left to the interpreter's exit, the window was
    destroyed after its platform window and the process aborted."""
    from app.__main__ import delete_windows

    window.close()
    del window
    delete_windows()


def open_gl_context() -> Any:
    """An OpenGL context made current, as a desktop's GL use would: on Mesa (llvmpipe under Xvfb) it loads the
    system's LLVM into the process."""
    from PySide6.QtGui import QOffscreenSurface, QOpenGLContext

    context, surface = QOpenGLContext(), QOffscreenSurface()
    surface.create()
    assert context.create() and context.makeCurrent(surface), "no OpenGL here"
    return context, surface


def prepare_demo(app: Any, window: Any, *, compile_on: bool) -> None:
    """The demo model, data and a long run (stopped by the cycles, never finished), no checkpoints on the way."""
    from engine.demo import DEMO_TRAIN_FILE

    win = window
    win.hardware_panel.detect()
    wait_until(app, lambda: win.state.hardware is not None, "hardware")
    win.model_panel.choose("demo")
    wait_until(app, lambda: win.state.model_info is not None, "demo model")
    win.data_panel.load(str(DEMO_TRAIN_FILE))
    wait_until(app, lambda: win.state.data_report is not None, "dataset report")
    form = win.setup_panel.form
    form.set_values({"training.max_steps": 100_000, "training.save_every": 0, "training.eval_every": 0})
    form.set_values({"speed.fused_kernels": True if compile_on else None})
    wait_until(app, lambda: not win.tasks.busy(), "background jobs")


def one_cycle(app: Any, window: Any, *, pause: bool) -> str:
    """Start, (pause, every page, resume,) stop; returns the run's folder."""
    from app.background import run_controller as rc
    from engine.events import RunFinished, RunStarted

    win = window
    controller = win.controller
    events: list[Any] = []
    controller.run_event.connect(events.append)
    panel = win.run_panel
    wait_until(app, panel.start_button.isEnabled, "Start enabled")  # the last run's end reaches it queued
    panel.start_button.click()
    wait_until(app, lambda: controller.state == rc.RUNNING and controller.last_step >= 1, "first step")
    if pause:
        panel.pause_button.click()
        wait_until(app, lambda: controller.state == rc.PAUSED, "pause")
        for title in win.page_titles():
            win.show_page(title)
            settle(app, 5)
        win.show_page("Run")
        paused_at = controller.last_step
        panel.resume_button.click()
        wait_until(app, lambda: controller.last_step > paused_at, "a step after resume")
    panel.stop_button.click()
    wait_until(app, lambda: not controller.active and controller.worker.isFinished(), "stop")
    controller.run_event.disconnect(events.append)
    assert controller.state == rc.FINISHED, f"run ended {controller.state}: {events[-1]!r}"
    finished = [e for e in events if isinstance(e, RunFinished)]
    started = [e for e in events if isinstance(e, RunStarted)]
    assert finished and finished[-1].cancelled and started, events[-3:]
    return str(started[-1].run_dir)


def chat(app: Any, window: Any, run_dir: str) -> None:
    """The stopped run and the base model answer one prompt on the Chat page (as tests/app_finish.chat_with)."""
    win = window
    page = win.page("Chat")
    win.show_page("Chat")
    wait_until(app, lambda: page.runs.findData(run_dir) >= 0, "the run on the Chat page")
    page.runs.setCurrentIndex(page.runs.findData(run_dir))
    page.max_tokens.setValue(8)
    page.compare.setChecked(True)
    wait_until(app, page.load_button.isEnabled, "Load enabled")
    page.load_button.click()
    wait_until(app, lambda: page.chat is not None and page.send_button.isEnabled(), "chat model")
    before = len(page.histories["base"])
    page.prompt.setText("Convert to ISO date: March 5, 2021")
    page.send_button.click()
    wait_until(app, lambda: len(page.histories["base"]) == before + 2 and not page._busy(), "chat answer")
    assert page.status.text() == "done", page.status.text()
    win.show_page("Run")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
