"""The GPU tests run in shards on a machine without Qt: every gpu-marked test is in exactly one shard of
tests/gpu_shards.py, and they all collect where PySide6 does not import (the GPU machine has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_shards import SHARDS, covers, entries, shards_of
from hang import HANG_S

ROOT = Path(__file__).resolve().parents[1]
NO_QT = "raise ImportError('no PySide6 here, as on the GPU machine')\n"


def collect_gpu_tests(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """Node ids of the gpu-marked tests, as ``pytest --collect-only -q -m gpu`` lists them."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "error" not in done.stdout.splitlines()[-1].lower(), done.stdout[-4000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def gpu_tests() -> list[str]:
    found = collect_gpu_tests()
    assert len(found) > 40 and any(t.startswith("tests/test_speed_gpu.py::") for t in found), found
    return found


@pytest.mark.slow
def test_every_gpu_test_is_in_exactly_one_shard(gpu_tests: list[str]) -> None:
    placed = {test: shards_of(test) for test in gpu_tests}
    assert not [t for t, shards in placed.items() if len(shards) != 1], {
        t: shards for t, shards in placed.items() if len(shards) != 1
    }
    stale = [e for name in SHARDS for e in SHARDS[name] if not any(covers(e, t) for t in gpu_tests)]
    assert not stale, f"shard entries that select no gpu-marked test: {stale}"


def test_shard_entries_select_their_own_tests_only() -> None:
    assert covers("tests/test_a.py", "tests/test_a.py::test_b[x]")
    assert covers("tests/test_a.py::test_b", "tests/test_a.py::test_b[x-1]")
    assert covers("tests/test_a.py::test_b", "tests/test_a.py::test_b")
    assert not covers("tests/test_a.py::test_b", "tests/test_a.py::test_bc")
    assert not covers("tests/test_a.py", "tests/test_ab.py::test_b")
    assert entries("all") == tuple(e for name in SHARDS for e in SHARDS[name])
    with pytest.raises(SystemExit, match="no shard"):
        entries("9")


@pytest.mark.slow
def test_the_gpu_tests_collect_without_qt(gpu_tests: list[str], tmp_path: Path) -> None:
    """With an import of PySide6 failing and no plugin loaded (no pytest-qt, no pytest-timeout), as on the GPU
    machine: the whole suite collects without error, the modules that need Qt left out, and finds the same GPU
    tests; so do the shards' files alone."""
    (tmp_path / "PySide6").mkdir()
    (tmp_path / "PySide6" / "__init__.py").write_text(NO_QT)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    without_qt = collect_gpu_tests(env=env)
    assert sorted(without_qt) == sorted(gpu_tests)
