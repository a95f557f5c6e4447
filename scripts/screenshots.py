"""Screenshots of every page in the light and the dark look, taken from the app as a user drives it.

The window opens at a laptop's 1366x768, picks the demo by itself (model, dataset, Demo recipe), and the script
clicks what a user clicks: Start on the guide bar, then, once the run finished, the run on the Chat page with a
question, Export on the Runs page, and the run's before/after report. Every page is then saved in both looks, with
the export dialog, under ``--out`` (``docs/screenshots``, the README's pictures, by default) as
``light/<page>.png`` and ``dark/<page>.png``.

The run's folder and history go to ``--workdir`` (``~/tunedeck-screenshots``; its ``runs`` and ``home`` folders
are emptied first), so the pictures show a user's paths and only this run. Offscreen by default; under a real X
server (``xvfb-run -a .venv/bin/python scripts/screenshots.py --platform xcb``) the window is a real one.

    .venv/bin/python scripts/screenshots.py [--out DIR] [--workdir DIR] [--size 1366x768] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

WAIT_S = 900.0
"""The longest any one stage may take (loading torch and the demo, the run, the chat) before the script gives up."""
PROMPT = "Convert to ISO date: March 5th, 1998"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"), help="folder of light/ and dark/")
    parser.add_argument("--workdir", type=Path, default=Path.home() / "tunedeck-screenshots",
                        help="where the run and its history go (its runs/ and home/ are emptied first)")  # fmt: skip
    parser.add_argument("--size", default="1366x768", help="window size, WIDTHxHEIGHT")
    parser.add_argument("--prompt", default=PROMPT, help="what the Chat page asks the fine-tuned model")
    parser.add_argument("--platform", default="offscreen", help="Qt platform: offscreen, or xcb under an X server")
    return parser.parse_args(argv)


def wait_for(app: Any, condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Let the window work until ``condition`` holds; a hang is reported with what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {timeout_s:.0f} s")
        app.processEvents()
        time.sleep(0.02)
    app.processEvents()


def palette_of(pixels: Any, size: int = 256, common: int = 160, near: int = 30, least: int = 12) -> list[int]:
    """A palette for ``pixels`` (0xAARRGGBB): the ``common`` most frequent colours, then colours seen at least
    ``least`` times that no colour so far is within ``near`` of (coloured text on a busy page would otherwise snap to
    a grey), most frequent first."""
    colors, counts = np.unique(pixels, return_counts=True)
    order = np.argsort(counts)[::-1]
    colors, counts = colors[order], counts[order]
    channels = np.stack([(colors >> shift) & 0xFF for shift in (16, 8, 0)], axis=1).astype(np.int32)
    chosen = list(range(min(common, len(colors))))
    for index in range(len(chosen), len(colors)):
        if len(chosen) >= size or counts[index] < least:
            break
        if np.abs(channels[chosen] - channels[index]).max(axis=1).min() > near:
            chosen.append(index)
    rest = (i for i in range(len(colors)) if i not in set(chosen))
    chosen += [next(rest) for _ in range(min(size, len(colors)) - len(chosen))]
    return [int(colors[i]) for i in chosen]


def fewer_colors(image: Any) -> Any:
    """The image on a palette of 256 colours: a third of the file size, flat colours exact."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage

    rgb = image.convertToFormat(QImage.Format.Format_RGB32)
    pixels = np.frombuffer(rgb.constBits(), np.uint32, count=rgb.bytesPerLine() // 4 * rgb.height())
    return rgb.convertToFormat(QImage.Format.Format_Indexed8, palette_of(pixels),
                               Qt.ImageConversionFlag.ThresholdDither)  # fmt: skip


def save(widget: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not fewer_colors(widget.grab().toImage()).save(str(path), "PNG", 9):
        raise SystemExit(f"could not write {path}")
    return path


def fresh_workdir(workdir: Path) -> None:
    for name in ("runs", "home"):
        shutil.rmtree(workdir / name, ignore_errors=True)
        (workdir / name).mkdir(parents=True)
    os.environ["TUNEDECK_HOME"] = str(workdir / "home")


def run_the_demo(app: Any, window: Any) -> str:
    """Start on the guide bar once the demo is ready, and wait for the run to finish; returns its folder."""
    from app.background import run_controller as rc

    guide = window.guide
    wait_for(app, guide.start_button.isEnabled, "the demo to be ready (machine, model, dataset, recipe)")
    wait_for(app, lambda: not window.tasks.busy(), "the pages' background work")
    guide.start_button.click()
    wait_for(app, lambda: window.controller.state == rc.FINISHED, "the demo run to finish")
    wait_for(app, lambda: not window.controller.worker.isRunning(), "the run's thread to end")
    wait_for(app, lambda: not window.tasks.busy(), "the history to be read again")
    return str(window.state.run.run_dir)


def chat(app: Any, window: Any, run_dir: str, prompt: str) -> str:
    page = window.page("Chat")
    window.show_page("Chat")
    index = page.runs.findData(str(Path(run_dir).resolve()))
    page.runs.setCurrentIndex(max(index, 0))
    page.temperature.setValue(0.0)  # the model's most likely answer
    page.max_tokens.setValue(24)
    page.load_button.click()
    wait_for(app, lambda: page.chat is not None and page.send_button.isEnabled(), "the tuned model to load")
    page.prompt.setText(prompt)
    page.send_button.click()
    wait_for(app, lambda: len(page.histories["base"]) == 2 and not page._busy(), "both answers")
    return str(page.histories["tuned"][-1]["content"])


def export_adapter(app: Any, window: Any, run_dir: str) -> Any:
    runs = window.page("Runs")
    window.show_page("Runs")
    runs.refresh()
    runs.select_runs([record.id for record in runs.records if Path(record.folder) == Path(run_dir).resolve()])
    dialog = runs.export_selected()
    dialog.export_button.click()
    wait_for(app, lambda: not dialog.busy() and dialog.open_button.isEnabled(), "the adapter export")
    return dialog


def show_report(app: Any, window: Any, run_dir: str) -> None:
    """The run's before/after report on the Report page (measured when the run ended)."""
    page = window.page("Report")
    window.open_report(run_dir)
    wait_for(app, lambda: page.report is not None and not page.busy(), "the before/after report")


def settle(app: Any, window: Any, seconds: float = 0.3) -> None:
    """Let background work end and the window repaint before a picture is taken."""
    wait_for(app, lambda: not window.tasks.busy(), "the pages' background work")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)


def save_pages(app: Any, window: Any, dialog: Any, look: str, out: Path) -> list[Path]:
    window.set_look(look == "dark")
    saved = []
    for title in window.page_titles():
        window.show_page(title)
        window.run_panel.charts.redraw_all()
        settle(app, window)
        saved.append(save(window, out / look / f"{title.lower().replace(' ', '-')}.png"))
    saved.append(save(dialog, out / look / "export.png"))
    return saved


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ["QT_QPA_PLATFORM"] = args.platform
    width, height = (int(part) for part in args.size.lower().split("x"))
    workdir = args.workdir.expanduser().resolve()
    fresh_workdir(workdir)
    os.chdir(workdir)  # the Recipe page's output folder, "runs", is then workdir/runs

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    app = QApplication([sys.argv[0]])
    settings = QSettings(str(workdir / "home" / "window.ini"), QSettings.Format.IniFormat)
    window = MainWindow(settings=settings)
    window.resize(width, height)
    window.show()
    run_dir = run_the_demo(app, window)
    answer = chat(app, window, run_dir, args.prompt)
    dialog = export_adapter(app, window, run_dir)
    show_report(app, window, run_dir)
    out = args.out if args.out.is_absolute() else Path(__file__).resolve().parents[1] / args.out
    saved = save_pages(app, window, dialog, "light", out) + save_pages(app, window, dialog, "dark", out)
    window.set_look(False)
    print(f"run: {run_dir}\nchat: {args.prompt!r} -> {answer!r}\n{window.run_panel.summary.text()}")
    print("\n".join(str(path) for path in saved))
    dialog.close()
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
