"""The GPU setup page: detection shown, install with real uv progress, cancel, repair, and opening without torch.

A fake ``uv`` (a small script) stands in for the real one, so the engine's own install job runs end to end: its
verbose lines give the package total and the folders it creates in the cache give the count done.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_MS, HANG_S
from PySide6.QtCore import Qt

from app.background.worker import TaskRunner
from app.pages.gpu_setup import STEPS, SetupView, overall_progress
from engine.setup import environment
from engine.setup.cancel import CancelToken
from engine.setup.environment import InstallLayout
from engine.setup.events import Progress, SetupFinished, StepStarted
from engine.setup.torch_build import DriverInfo, NvidiaGpu, TorchChoice

pytest_plugins = ["app_fixtures"]

SCREENSHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
RTX_5090 = DriverInfo("570.86", (12, 8), (NvidiaGpu("NVIDIA GeForce RTX 5090", (12, 0)),), "nvml")
OLD_DRIVER_5090 = DriverInfo("560.35", (12, 6), RTX_5090.gpus, "nvml")
NO_GPU = DriverInfo(None, None, (), "none", "NVML: NVMLError_LibraryNotFound")
TIMEOUT_MS = HANG_MS

FAKE_UV = """#!{python}
import os, sys, time
cache = os.path.join(os.environ["UV_CACHE_DIR"], "archive-v0")
packages = ["torch", "nvidia-cublas", "sympy"]
for name in packages:
    print("DEBUG Identified uncached distribution: " + name, flush=True)
if "{mode}" == "hang":
    print("Resolved 3 packages", flush=True)
    time.sleep(600)
seen = os.environ.get("FAKE_UV_SEEN")
for index, name in enumerate(packages):
    os.makedirs(os.path.join(cache, name), exist_ok=True)
    print("Prepared " + name, flush=True)
    waited = 0.0
    while seen and index == 0 and not os.path.exists(seen) and waited < 60:  # the window showed a package land
        time.sleep(0.05)
        waited += 0.05
print("Installed 3 packages", flush=True)
"""


def make_layout(tmp_path: Path, mode: str = "ok") -> InstallLayout:
    """An installation in a folder with spaces and a long path, with a fake uv and Python in it."""
    root = tmp_path / "My Programs" / ("long folder name " * 6).strip() / "TuneDeck"
    layout = InstallLayout(root, windows=False)
    layout.python().parent.mkdir(parents=True)
    layout.python().write_text("")
    layout.uv.write_text(FAKE_UV.format(python=sys.executable, mode=mode))
    layout.uv.chmod(layout.uv.stat().st_mode | stat.S_IEXEC)
    return layout


@pytest.fixture
def tasks() -> Iterator[TaskRunner]:
    runner = TaskRunner()
    yield runner
    runner.wait_all()


def make_view(qtbot: Any, tasks: TaskRunner, layout: InstallLayout | None, driver: DriverInfo, **jobs: Any) -> Any:
    view = SetupView(tasks, layout=layout, detect=lambda: driver, **jobs)
    qtbot.addWidget(view)
    view.resize(1000, 720)
    view.show_driver(driver)
    return view


def test_rtx_5090_with_a_cuda_12_8_driver_gets_cu128(qtbot: Any, tasks: TaskRunner, tmp_path: Path) -> None:
    view = make_view(qtbot, tasks, make_layout(tmp_path), RTX_5090)
    assert "RTX 5090 (sm_120)" in view.gpu_label.text()
    assert "570.86" in view.driver_label.text() and "CUDA 12.8" in view.driver_label.text()
    assert view.choice().build == "cu128" and view.build_box.itemText(0) == "Automatic (cu128)"
    assert "7.0 GB" in view.space_label.text() and "free on this drive" in view.space_label.text()
    assert view.install_button.isEnabled() and view.repair_button.isEnabled()
    assert not view.cancel_button.isEnabled()


def test_no_gpu_offers_the_cpu_build_with_a_warning(qtbot: Any, tasks: TaskRunner, tmp_path: Path) -> None:
    view = make_view(qtbot, tasks, make_layout(tmp_path), NO_GPU)
    assert "no NVIDIA GPU" in view.gpu_label.text()
    assert view.choice().build == "cpu"
    assert "too slow" in view.warnings.text()
    assert view.install_button.isEnabled()


def test_old_driver_on_blackwell_says_update_and_blocks_install(qtbot: Any, tasks: TaskRunner, tmp_path: Path) -> None:
    view = make_view(qtbot, tasks, make_layout(tmp_path), OLD_DRIVER_5090)
    assert "Update your NVIDIA driver to at least version 570" in view.warnings.text()
    assert not view.install_button.isEnabled() and not view.repair_button.isEnabled()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert view.grab().save(str(SCREENSHOTS / "setup_view_old_driver.png"))
    view.build_box.setCurrentIndex(view.build_box.findData("cpu"))  # the user accepts the CPU build
    assert view.choice().overridden and view.install_button.isEnabled()


def test_detection_runs_in_the_background(qtbot: Any, tasks: TaskRunner) -> None:
    view = SetupView(tasks, layout=None, detect=lambda: RTX_5090)
    qtbot.addWidget(view)
    view.refresh()
    qtbot.waitUntil(lambda: view.driver is not None, timeout=TIMEOUT_MS)
    assert "RTX 5090" in view.gpu_label.text()
    assert not view.install_button.isEnabled(), "a developer checkout is not an installation to set up"
    assert "developer checkout" in view.status.text()


def test_overall_progress_splits_the_bar_between_steps() -> None:
    assert overall_progress((1, 1), 0, 0) == 0
    assert overall_progress((1, 2), 1, 2) == STEPS // 4
    assert overall_progress((2, 2), 3, 3) == STEPS
    assert overall_progress((3, 4), 5, 0) == STEPS // 2  # unknown total: the step's start


def test_install_shows_uv_progress_and_log(qtbot: Any, tasks: TaskRunner, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(environment, "free_bytes", lambda path: 80_000_000_000)  # any CI disk passes the check
    layout = make_layout(tmp_path)
    view = make_view(qtbot, tasks, layout, RTX_5090)
    values: list[int] = []
    seen = tmp_path / "progress-seen"  # the fake uv goes on once the bar has moved: no race with a busy machine
    monkeypatch.setenv("FAKE_UV_SEEN", str(seen))

    def record(value: int) -> None:
        values.append(value)
        if 0 < value < STEPS:
            seen.touch()

    view.progress.valueChanged.connect(record)
    announced: list[bool] = []
    view.installed.connect(lambda: announced.append(True))
    # job_ended: the thread's end reaches the view after isRunning() drops
    with qtbot.waitSignal(view.job_ended, timeout=TIMEOUT_MS):
        qtbot.mouseClick(view.install_button, Qt.MouseButton.LeftButton)
        assert view.cancel_button.isEnabled() and not view.install_button.isEnabled()
    assert view.result.text().startswith("✔ torch cu128 installed"), view.result.text()
    assert 0 < min(v for v in values if v) < STEPS and values[-1] == STEPS, values
    log = view.log.toPlainText()
    assert "Prepared torch" in log and "Installed 3 packages" in log
    assert layout.read_marker()["torch_build"] == "cu128" and announced == [True]
    assert view.install_button.isEnabled() and not view.cancel_button.isEnabled()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert view.grab().save(str(SCREENSHOTS / "setup_view.png"))


def test_cancel_stops_uv_and_says_cancelled(qtbot: Any, tasks: TaskRunner, tmp_path: Path) -> None:
    view = make_view(qtbot, tasks, make_layout(tmp_path, mode="hang"), NO_GPU)
    view.start_job("install")
    qtbot.waitUntil(lambda: "Resolved 3 packages" in view.log.toPlainText(), timeout=TIMEOUT_MS)
    qtbot.mouseClick(view.cancel_button, Qt.MouseButton.LeftButton)
    assert view.worker.cancel_token.cancelled
    qtbot.waitUntil(lambda: not view.running(), timeout=TIMEOUT_MS)  # well before uv's 600 s were up
    qtbot.waitUntil(lambda: view.result.text() != "", timeout=TIMEOUT_MS)
    assert view.result.text().startswith("Cancelled"), view.result.text()
    assert view.progress.value() < STEPS


def test_repair_calls_the_repair_job(qtbot: Any, tasks: TaskRunner, tmp_path: Path) -> None:
    calls: list[tuple[InstallLayout, TorchChoice, CancelToken]] = []

    def repair(layout: InstallLayout, choice: TorchChoice, wheelhouse: Path | None, cancel: CancelToken) -> Any:
        calls.append((layout, choice, cancel))
        yield StepStarted(1, 4, "Creating the Python 3.12 environment")
        yield Progress(1, 2, "packages")
        yield StepStarted(4, 4, "Checking the new environment")
        yield SetupFinished("environment rebuilt: Python 3.12.8, torch 2.13.0", restart_needed=True)

    layout = make_layout(tmp_path)
    view = make_view(qtbot, tasks, layout, RTX_5090, repair_job=repair)
    qtbot.mouseClick(view.repair_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not view.running() and view.result.text() != "", timeout=TIMEOUT_MS)
    assert [(c[0], c[1].build) for c in calls] == [(layout, "cu128")]
    assert "environment rebuilt" in view.result.text() and "Restart TuneDeck" in view.result.text()
    assert "Checking the new environment" in view.log.toPlainText()


def test_a_failing_job_is_shown_not_lost(qtbot: Any, tasks: TaskRunner, tmp_path: Path) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("uv was not found: reinstall TuneDeck, or install uv")
        yield  # a generator, like the real jobs

    view = make_view(qtbot, tasks, make_layout(tmp_path), RTX_5090, install_job=broken)
    view.start_job("install")
    qtbot.waitUntil(lambda: not view.running() and view.result.text() != "", timeout=TIMEOUT_MS)
    assert view.result.text().startswith("✘") and "uv was not found" in view.result.text()


def test_window_opens_on_setup_when_torch_is_missing(qtbot: Any, tmp_path: Path, monkeypatch: Any) -> None:
    from app.main_window import MainWindow

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    window = MainWindow(detect_on_show=False)
    qtbot.addWidget(window)
    assert window.pages.currentWidget().panel is window.setup_view
    assert "not installed yet" in window.setup_view.status.text() or "developer" in window.setup_view.status.text()
    window.close()


def test_window_opens_elsewhere_when_torch_is_there(qtbot: Any, tmp_path: Path, monkeypatch: Any) -> None:
    from app.main_window import MainWindow

    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    window = MainWindow(detect_on_show=False)
    qtbot.addWidget(window)
    assert window.nav.currentRow() == 0 and "GPU setup" in window.page_titles()
    window.close()


def test_window_without_torch_never_imports_it(tmp_path: Path) -> None:
    """In a fresh process where importing torch fails loudly, the window opens and detects on the setup page."""
    code = textwrap.dedent("""
        import importlib.util, sys, time
        attempts = []
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    attempts.append(name)
                    raise ImportError("torch was imported")
        sys.meta_path.insert(0, NoTorch())
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "torch" else real(name, *a)
        from PySide6.QtWidgets import QApplication
        app = QApplication(["tunedeck"])
        from app.main_window import MainWindow
        window = MainWindow()
        window.show()
        deadline = time.monotonic() + float(sys.argv[1])  # the hang bound
        while window.setup_view.driver is None and time.monotonic() < deadline:
            app.processEvents()
            window.tasks.wait_all(100)
        app.processEvents()
        assert window.pages.currentWidget().panel is window.setup_view
        assert window.setup_view.driver is not None
        window.close()
        window.tasks.wait_all()
        app.processEvents()
        assert not attempts and "torch" not in sys.modules, attempts
        print("ok")
    """)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "TUNEDECK_HOME": str(tmp_path / "home"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code, str(HANG_S)], capture_output=True, text=True, timeout=HANG_S,
                            env=env)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_too_little_space_is_shown_and_install_refuses(
    qtbot: Any, tasks: TaskRunner, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(environment, "free_bytes", lambda path: 2_000_000_000)
    view = make_view(qtbot, tasks, make_layout(tmp_path), RTX_5090)
    assert "2.0 GB free" in view.space_label.text() and "b00020" in view.space_label.styleSheet()
    view.start_job("install")
    qtbot.waitUntil(lambda: not view.running() and view.result.text() != "", timeout=TIMEOUT_MS)
    assert "Not enough disk space" in view.result.text() and view.log.toPlainText() == ""
