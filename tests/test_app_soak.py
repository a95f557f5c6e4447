"""The window in daily use, each test in a process of its own (tests/window_soak_child.py), so that a crash is a
failed test with its signal and the crash log, not a dead test session.

* Soak: a warm-up cycle, then 8 cycles of Start, Pause, every page shown, Resume and Stop of the demo run, with a
  chat every fourth cycle (the warm-up's and the last one's included): the process ends normally, the window never
  grows, and its resident memory (measured after each cycle, garbage collected on the GUI thread) grows at most
  0.5% of the warm-up's per cycle. The leak this guards against (a run's freed heap kept by the window: 807 ->
  1,030 MiB over 21 cycles, about 1.4% a cycle) is over 10% after 8 cycles, against the 4% allowed; with the heap
  handed back, 21 cycles went 764 -> 776 MiB. ``TUNEDECK_SOAK_CYCLES=20`` runs the long soak (10% allowed).
* The libLLVM crash (engine.crash_guard): with the system's LLVM loaded the way Mesa's OpenGL driver loads it, a
  Start with compiled kernels trains in a window started as ``tunedeck`` starts it; the same Start without Triton's
  library loaded first dies with a segmentation fault in the run's thread, which shows the test can fail.

Set QT_QPA_PLATFORM=xcb and run under ``xvfb-run`` for a real X server, where the LLVM comes from a real OpenGL
context (llvmpipe); the default is offscreen.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from window_soak_child import system_llvm

from engine.crash_guard import CRASH_LOG, preload_compiler_libraries

CHILD = Path(__file__).with_name("window_soak_child.py")
HANG_S = 3600
"""Bounds a hang of the whole child; every wait inside it is for a condition."""
SOAK_CYCLES = int(os.environ.get("TUNEDECK_SOAK_CYCLES", "8"))
"""Cycles after the warm-up; set TUNEDECK_SOAK_CYCLES=20 (or more) for the long soak."""
CHAT_EVERY = 4
RSS_GROWTH_PER_CYCLE = 0.005
"""Allowed growth of resident memory per cycle, as a share of the warm-up's: 4% over 8 cycles, 10% over 20."""


def load_llvm_as_a_desktop_does() -> str:
    """Under an X server, a real OpenGL context (Mesa loads its LLVM); offscreen, the system's LLVM loaded directly."""
    return "--gl-context" if os.environ.get("QT_QPA_PLATFORM") == "xcb" else "--system-llvm"


def run_window(folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    command = [sys.executable, "-X", "faulthandler", str(CHILD), "--folder", str(folder), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, env=env, check=False)


def ending(proc: subprocess.CompletedProcess[str], folder: Path) -> str:
    """How the child ended, for an assertion message: its exit or signal, its last output and its crash log."""
    code = proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    log = folder / "home" / CRASH_LOG
    crash = log.read_text(encoding="utf-8", errors="replace")[-4000:] if log.exists() else "(no crash log)"
    return f"{how}\n--- stderr ---\n{proc.stderr[-4000:]}\n--- crash log ---\n{crash}"


def measurements(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [row for row in rows if "cycle" in row]


def test_repeated_cycles_leave_the_window_and_its_memory_where_they_were(tmp_path: Path) -> None:
    cycles = str(SOAK_CYCLES + 1)  # the first is the warm-up
    proc = run_window(tmp_path, "--as-app", "--cycles", cycles, "--pause", "--chat-every", str(CHAT_EVERY))
    assert proc.returncode == 0, ending(proc, tmp_path)
    rows = measurements(proc)
    assert len(rows) == SOAK_CYCLES + 1, proc.stdout
    warm, last = rows[0], rows[-1]
    sizes = {(row["width"], row["height"]) for row in rows}
    assert sizes == {(warm["width"], warm["height"])}, f"the window changed size: {sorted(sizes)}"
    growth = last["rss"] / warm["rss"] - 1
    trend = ", ".join(f"{row['rss'] / 2**20:.0f}" for row in rows)
    assert growth <= RSS_GROWTH_PER_CYCLE * SOAK_CYCLES, (
        f"resident memory grew {growth:.1%} over {SOAK_CYCLES} cycles (MiB: {trend})"
    )


needs_llvm_pair = pytest.mark.skipif(
    system_llvm() is None or not preload_compiler_libraries(),
    reason="needs the system's shared LLVM (Mesa's OpenGL drivers install it) and Triton",
)


@needs_llvm_pair
def test_a_start_after_the_system_llvm_loaded_trains_with_compiled_kernels(tmp_path: Path) -> None:
    proc = run_window(tmp_path, "--as-app", load_llvm_as_a_desktop_does(), "--compile", "--cycles", "1")
    assert proc.returncode == 0, ending(proc, tmp_path)
    assert len(measurements(proc)) == 1, proc.stdout


@needs_llvm_pair
def test_the_same_start_without_triton_loaded_first_dies_in_the_run_thread(tmp_path: Path) -> None:
    proc = run_window(tmp_path, load_llvm_as_a_desktop_does(), "--cycles", "1")
    if proc.returncode == 0:
        pytest.skip("this Triton build no longer clashes with the system's LLVM")
    assert proc.returncode == -signal.SIGSEGV, ending(proc, tmp_path)
    assert "triton" in proc.stderr and "Segmentation fault" in proc.stderr, proc.stderr[-4000:]
