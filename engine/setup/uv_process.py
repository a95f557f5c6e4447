"""Running uv with live progress and a working Cancel.

uv draws progress bars only on a terminal. Run verbosely, it logs "Identified uncached distribution: X" for every
package it still has to download and unpack, which gives the total; each prepared package becomes one new folder
in the cache's ``archive-v0``, which gives the count done. Both work the same on Windows and Linux and for
downloads and local wheels alike. Cancel terminates uv's whole process group.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import IO, Any

from engine.setup.cancel import CancelToken
from engine.setup.events import OutputLine, Progress, SetupCancelled, SetupEvent, SetupFailed

_UNCACHED = "Identified uncached distribution:"
_POLL_SECONDS = 0.25


def _archives(cache_dir: Path) -> set[str]:
    folder = cache_dir / "archive-v0"
    return {entry.name for entry in folder.iterdir()} if folder.is_dir() else set()


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\r\n"))
    lines.put(None)


def _start(argv: list[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
    extra: dict[str, Any] = {}
    if sys.platform == "win32":
        extra["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP | subprocess.CREATE_NO_WINDOW  # type: ignore[attr-defined]
    else:
        extra["start_new_session"] = True
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                            errors="replace", env=dict(env), **extra)  # fmt: skip


def _stop(process: subprocess.Popen[str]) -> None:
    try:
        if sys.platform == "win32":
            process.terminate()
        else:
            os.killpg(process.pid, 15)
        process.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()


def run_uv(
    argv: list[str],
    env: Mapping[str, str],
    cache_dir: Path,
    cancel: CancelToken | None = None,
    log: IO[str] | None = None,
) -> Generator[SetupEvent, None, bool]:
    """Run uv (``argv[0]`` is its path), yielding its lines and package progress; returns True on success."""
    before = _archives(cache_dir)
    process = _start([*argv, "--verbose"], env)
    lines: queue.Queue[str | None] = queue.Queue()
    assert process.stdout is not None
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    total, done = 0, 0
    reported = (0, 0)
    tail: list[str] = []
    while True:
        if cancel is not None and cancel.cancelled:
            _stop(process)
            yield SetupCancelled("stopped; use Repair to finish or rebuild the environment")
            return False
        try:
            line = lines.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if log is not None and line:
            log.write(line + "\n")
        if line.startswith("DEBUG "):
            if _UNCACHED in line:
                total += 1
        elif line:
            tail = [*tail[-19:], line]
            yield OutputLine(line)
        done = min(len(_archives(cache_dir) - before), total)
        if done < total and (done, total) != reported:  # all done is said once uv has ended: it installs last
            reported = (done, total)
            yield Progress(done, total, "packages")
    code = process.wait()
    if code != 0:
        errors = [text for text in tail if text.startswith(("error", "  ", "hint", "Caused by"))] or tail[-5:]
        yield SetupFailed(f"uv exited with code {code}", "\n".join(errors))
        return False
    if total:
        yield Progress(total, total, "packages")
    return True
