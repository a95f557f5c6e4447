"""Live GPU telemetry: a background thread samples NVML about twice a second and delivers events.

Each sample (memory, utilisation, temperature, power, clocks, throttle reasons, the process's own memory) is a
:class:`TelemetrySample`; the app charts them. Two conditions become a :class:`TelemetryWarning` once, when they
start: the process's GPU memory above the card's dedicated memory (Windows then silently spills into shared
system memory and training slows many-fold) and thermal/hardware throttling. Without NVML (CPU, no driver) the
sampler still reports the process's resident memory. Sampling never raises into the caller.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.events import Event
from engine.hardware.detect import SERIOUS_THROTTLE_MASK, THROTTLE_REASONS, safe_read, throttle_mask

SPILL = "shared-memory-spill"
THROTTLE = "throttling"


@dataclass(frozen=True)
class TelemetrySample(Event):
    time_s: float
    gpu_index: int | None
    """None on the CPU path (no NVIDIA GPU or no driver)."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    process_gpu_memory_bytes: int | None
    """This process's GPU memory (the allocator's reservation when torch has started CUDA, else NVML's figure)."""
    utilization_pct: float | None
    memory_utilization_pct: float | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    throttle_reasons: tuple[str, ...]
    process_rss_bytes: int | None


@dataclass(frozen=True)
class TelemetryWarning(Event):
    code: str
    """'shared-memory-spill' or 'throttling'."""
    message: str
    time_s: float


def process_rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc, Windows API, else the peak from getrusage)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    if sys.platform == "win32":
        return _windows_rss()
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024
    except (ImportError, OSError):
        return None


def _windows_rss() -> int | None:
    try:
        import ctypes
        from ctypes import wintypes

        class Counters(ctypes.Structure):
            _fields_ = [("cb", wintypes.DWORD), ("faults", wintypes.DWORD)] + [
                (name, ctypes.c_size_t)
                for name in ("peak_ws", "ws", "qpp", "qp", "qnpp", "qnp", "pagefile", "peak_pagefile")
            ]

        counters = Counters()
        counters.cb = ctypes.sizeof(Counters)
        kernel = ctypes.windll.kernel32  # type: ignore[attr-defined]
        psapi = ctypes.windll.psapi  # type: ignore[attr-defined]
        if psapi.GetProcessMemoryInfo(kernel.GetCurrentProcess(), ctypes.byref(counters), counters.cb):
            return int(counters.ws)
    except Exception:
        pass
    return None


def _process_family(pid: int) -> set[int]:
    """``pid`` and its descendants: a run on several GPUs trains in child processes, one per card."""
    family = {pid}
    try:
        import psutil

        family |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except Exception:  # psutil missing, or the process just ended: the process itself is enough
        pass
    return family


def _torch_reserved(device_index: int) -> int | None:
    """The allocator's reservation, only if this process already started CUDA (never initialises it)."""
    torch = sys.modules.get("torch")
    if torch is None or not safe_read(lambda: torch.cuda.is_initialized(), False):
        return None
    return safe_read(lambda: int(torch.cuda.memory_reserved(device_index)))


class TelemetrySampler:
    """Samples GPU ``device_index`` every ``interval_s`` in a daemon thread.

    Events go to ``callback`` (called from the sampler thread) or, without one, to the ``events`` queue.
    ``nvml`` defaults to pynvml; pass None to force the CPU path, or a fake in tests.
    """

    def __init__(
        self,
        callback: Callable[[Event], None] | None = None,
        *,
        interval_s: float = 0.5,
        device_index: int = 0,
        device_indices: Sequence[int] | None = None,
        nvml: Any = ...,
        pid: int | None = None,
    ) -> None:
        self.callback = callback
        self.events: queue.Queue[Event] = queue.Queue()
        self.interval_s = interval_s
        self.device_indices = tuple(device_indices) if device_indices else (device_index,)
        """Every GPU of the run: a run on several GPUs gets one sample per card per tick (the app's lanes)."""
        self.pid = os.getpid() if pid is None else pid
        self._nvml = nvml
        self._handles: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._active: set[tuple[str, int | None]] = set()
        self._start_time = time.monotonic()

    @property
    def device_index(self) -> int:
        return self.device_indices[0]

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._start_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tunedeck-telemetry", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        self._open()
        try:
            while not self._stop.is_set():
                for event in self.sample_events():
                    self._deliver(event)
                self._stop.wait(self.interval_s)
        finally:
            if self._handles:
                safe_read(self._nvml.nvmlShutdown)

    def _open(self) -> None:
        if self._nvml is ...:
            try:
                import pynvml

                self._nvml = pynvml
            except ImportError:
                self._nvml = None
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlInit()
        except Exception:  # no driver (NVMLError_LibraryNotFound): CPU path
            return
        for index in self.device_indices:
            handle = safe_read(lambda index=index: self._nvml.nvmlDeviceGetHandleByIndex(index))
            if handle is not None:  # a card that went away is left out, the others are still charted
                self._handles[index] = handle

    def _deliver(self, event: Event) -> None:
        if self.callback is None:
            self.events.put(event)
            return
        with contextlib.suppress(Exception):  # a failing consumer must not kill sampling
            self.callback(event)

    def sample_events(self) -> list[Event]:
        """One sample per GPU and the warnings that start with them (also usable without the thread)."""
        events: list[Event] = []
        cards: list[tuple[int | None, Any]] = list(self._handles.items()) or [(None, None)]
        rss = process_rss_bytes()
        family = _process_family(self.pid) if self._handles else {self.pid}  # once per tick, not per card
        for index, handle in cards:
            try:
                sample = self._sample(index, handle, rss, family)
            except Exception:
                continue
            events += [sample, *self._warnings(sample)]
        return events

    def _sample(self, index: int | None, handle: Any, rss: int | None, family: set[int]) -> TelemetrySample:
        now = time.monotonic() - self._start_time
        if handle is None or index is None:
            return TelemetrySample(now, None, None, None, None, None, None, None, None, None, None, None, (), rss)
        nvml = self._nvml
        memory = safe_read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        rates = safe_read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        milliwatts = safe_read(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        limit = safe_read(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        mask = throttle_mask(nvml, handle) or 0
        return TelemetrySample(
            time_s=now,
            gpu_index=index,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            process_gpu_memory_bytes=_torch_reserved(index) or self._process_memory(handle, family),
            utilization_pct=float(rates.gpu) if rates is not None else None,
            memory_utilization_pct=float(rates.memory) if rates is not None else None,
            temperature_c=safe_read(lambda: float(nvml.nvmlDeviceGetTemperature(handle, 0))),
            power_w=milliwatts / 1000 if milliwatts is not None else None,
            power_limit_w=limit / 1000 if limit is not None else None,
            sm_clock_mhz=safe_read(lambda: int(nvml.nvmlDeviceGetClockInfo(handle, 1))),
            memory_clock_mhz=safe_read(lambda: int(nvml.nvmlDeviceGetClockInfo(handle, 2))),
            throttle_reasons=tuple(label for bit, label in THROTTLE_REASONS.items() if mask & bit),
            process_rss_bytes=rss,
        )

    def _process_memory(self, handle: Any, family: set[int]) -> int | None:
        """NVML's figure for this process and its children (the ranks of a multi-GPU run); None on Windows WDDM,
        where the driver does not report it."""
        processes = safe_read(lambda: self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        used = [getattr(p, "usedGpuMemory", None) for p in processes if getattr(p, "pid", None) in family]
        total = sum(int(u) for u in used if u)
        return total or None

    def _warnings(self, sample: TelemetrySample) -> list[TelemetryWarning]:
        found: dict[str, str] = {}
        total, mine = sample.memory_total_bytes, sample.process_gpu_memory_bytes
        if total and mine and mine > total:
            found[SPILL] = (
                f"this run uses {mine / 2**30:.1f} GiB of GPU memory but the card has {total / 2**30:.1f} GiB: "
                "the driver is spilling into shared system memory and training will be many times slower; "
                "lower tokens per batch or turn on checkpointing"
            )
        serious = [
            r for bit, r in THROTTLE_REASONS.items() if bit & SERIOUS_THROTTLE_MASK and r in sample.throttle_reasons
        ]
        if serious:
            temp = f" at {sample.temperature_c:.0f} °C" if sample.temperature_c is not None else ""
            found[THROTTLE] = f"the GPU is throttling ({', '.join(serious)}){temp}: steps will be slower"
        card = sample.gpu_index
        prefix = f"GPU {card}: " if len(self.device_indices) > 1 else ""
        new = [
            TelemetryWarning(code, prefix + message, sample.time_s)
            for code, message in found.items()
            if (code, card) not in self._active
        ]
        self._active = {key for key in self._active if key[1] != card} | {(code, card) for code in found}
        return new
