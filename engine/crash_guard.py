"""Keeping native crashes away from the window, and leaving a trace when one happens anyway.

**Two LLVMs in one process.** Triton's native library (``triton/_C/libtriton.so``, loaded by the first import of
``torch._dynamo`` or ``torch._inductor``, which loading a transformers model or a run's compile cache makes) carries
its own copy of LLVM with its symbols exported. Mesa's OpenGL drivers link the system's ``libLLVM`` and are opened
with ``RTLD_GLOBAL``, so once anything in the process has made an OpenGL context on Linux (a platform plugin, theme
or dialog may; under Xvfb it is llvmpipe), those LLVM symbols come first in the global scope. Triton loaded after
that binds its own static initialisers to the system's LLVM of another version, and the process dies with a
segmentation fault in ``libLLVM``'s ``cl::Option::addArgument``, on the thread that imported it: the window's
``TrainingWorker`` at Start. Seen here (Debian 12, Mesa 22.3 with LLVM 15, Triton 3.9): an import on a QThread after
an llvmpipe GL context crashed in 5 of 5 tries and in none of 5 with this preload, and a window's Start crashed the
same way; it depends on what made a GL context before the first Start, hence "not every try". Loading Triton's
library first, privately (``RTLD_LOCAL``) and with every symbol bound at once (``RTLD_NOW``), binds it to its own
LLVM for good; the later import finds it loaded. It costs about 65 ms at start-up and needs no torch import.

**A trace of any crash.** :func:`enable_crash_log` points :mod:`faulthandler` at ``crash.log`` in the data
folder: a fatal signal in any thread writes every Python thread's stack there before the process ends.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import faulthandler
import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import IO

__all__ = ["CRASH_LOG", "LLVM_CARRIERS", "enable_crash_log", "preload_compiler_libraries"]

CRASH_LOG = "crash.log"
LLVM_CARRIERS: tuple[tuple[str, str], ...] = (("triton", "_C/libtriton*.so"),)
"""(package, glob inside it) of the native libraries that carry their own LLVM with exported symbols."""
KEEP_LOG_BYTES = 256 * 1024
"""What of an old crash log is kept when it passes a megabyte: the latest crashes."""


@functools.cache
def preload_compiler_libraries() -> tuple[str, ...]:
    """Load every installed LLVM-carrying library privately, before anything can load the system's LLVM; returns
    the paths loaded. Call it first thing in a process that shows a window; later calls do nothing."""
    if not sys.platform.startswith("linux"):  # the clash is ELF's global symbol scope
        return ()
    loaded = []
    for package, pattern in LLVM_CARRIERS:
        spec = importlib.util.find_spec(package)  # finds the package without running it
        if spec is None or spec.origin is None:
            continue
        for library in sorted(Path(spec.origin).parent.glob(pattern)):
            try:
                ctypes.CDLL(str(library), mode=os.RTLD_LOCAL | os.RTLD_NOW)
            except OSError:  # a broken install fails at its own import later, with its own message
                continue
            loaded.append(str(library))
    return tuple(loaded)


def enable_crash_log(folder: Path) -> Path | None:
    """Write the Python stacks of every thread to ``folder/crash.log`` on a fatal signal; returns the log's path,
    or None where it cannot be written (the app runs on without it)."""
    path = folder / CRASH_LOG
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _trim(path)
        log: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the process's lifetime)
        log.write(f"--- TuneDeck started {dt.datetime.now().isoformat(timespec='seconds')}, pid {os.getpid()}\n")
        log.flush()
    except OSError:
        return None
    faulthandler.enable(log, all_threads=True)  # faulthandler keeps the file object alive
    return path


def _trim(path: Path) -> None:
    if path.exists() and path.stat().st_size > 4 * KEEP_LOG_BYTES:
        tail = path.read_bytes()[-KEEP_LOG_BYTES:]
        path.write_bytes(tail[tail.find(b"\n") + 1 :])
