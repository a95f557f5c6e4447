"""engine.crash_guard: a fatal signal in any thread leaves every Python thread's stack in the data folder's crash
log (Triton's LLVM loaded first is tested on the window: tests/test_app_soak.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from engine.crash_guard import CRASH_LOG

CRASH_IN_A_THREAD = """
import faulthandler, sys, threading
from pathlib import Path
from engine.crash_guard import enable_crash_log
enable_crash_log(Path(sys.argv[1]))
def training_step():
    faulthandler._sigsegv()
thread = threading.Thread(target=training_step, name="TrainingWorker")
thread.start()
thread.join()
"""


def test_a_crash_in_a_thread_leaves_its_stack_in_the_crash_log(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", CRASH_IN_A_THREAD, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGSEGV
    log = (tmp_path / CRASH_LOG).read_text(encoding="utf-8")
    assert log.startswith("--- TuneDeck started ")
    assert "Fatal Python error: Segmentation fault" in log
    assert "in training_step" in log, log


TRIM_AND_ENABLE = """
import sys
from pathlib import Path
from engine.crash_guard import enable_crash_log
print(enable_crash_log(Path(sys.argv[1])))
"""


def test_an_old_crash_log_keeps_its_latest_part(tmp_path: Path) -> None:
    (tmp_path / CRASH_LOG).write_text("".join(f"old line {i}\n" for i in range(200_000)), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-c", TRIM_AND_ENABLE, str(tmp_path)], capture_output=True, text=True)
    assert proc.stdout.strip() == str(tmp_path / CRASH_LOG), proc.stderr
    text = (tmp_path / CRASH_LOG).read_text(encoding="utf-8")
    assert len(text) < 300 * 1024 and text.startswith("old line ")
    assert "old line 199999\n--- TuneDeck started " in text
