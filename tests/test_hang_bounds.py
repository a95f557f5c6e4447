"""The suite's only time limits are hang bounds: every wait for a condition or a child process uses tests/hang.py's
bound, and pytest-timeout's per-test guard sits above it, so a slow, busy machine is never a failure."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from hang import HANG_S

TESTS = Path(__file__).parent
LITERAL_TIMEOUT = re.compile(r"timeout\s*(?::\s*\w+\s*)?=\s*\d|monotonic\(\)\s*\+\s*\d")
"""``timeout=30`` in a call, ``timeout: float = 30`` as a default, or ``time.monotonic() + 30`` as a deadline."""
NOT_A_HANG_BOUND = "# not a hang bound"
"""Marks a timeout that a test expects to expire (a process that must still be running after it)."""


def test_no_test_waits_on_a_fixed_time() -> None:
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(TESTS.glob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if LITERAL_TIMEOUT.search(line) and NOT_A_HANG_BOUND not in line and path.name != Path(__file__).name
    ]
    assert not found, "use hang.HANG_S / HANG_MS instead of a fixed timeout:\n" + "\n".join(found)


def test_the_per_test_guard_sits_above_every_hang_bound() -> None:
    options = tomllib.loads((TESTS.parent / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]
    soak = re.search(r"^HANG_S = (\d+)", (TESTS / "test_app_soak.py").read_text(encoding="utf-8"), re.M)
    assert soak is not None
    assert options["ini_options"]["timeout"] > max(HANG_S, float(soak.group(1)))


def test_a_fixed_timeout_is_found_in_a_call_and_in_a_default() -> None:
    fixed = ("proc.wait(timeout=30)", "def run(argv: list[str], timeout: int = 600) -> None:", "timeout = 5",
             "deadline = time.monotonic() + 240")  # fmt: skip
    for line in fixed:
        assert LITERAL_TIMEOUT.search(line), line
    bounded = ("proc.wait(timeout=HANG_S)", "def run(argv: list[str], timeout: float = HANG_S) -> None:",
               "deadline = time.monotonic() + float(sys.argv[1])")  # fmt: skip
    for line in bounded:
        assert not LITERAL_TIMEOUT.search(line), line
