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
from collections.abc import Callable
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
        nvml: Any = ...,
        pid: int | None = None,
    ) -> None:
        self.callback = callback
        self.events: queue.Queue[Event] = queue.Queue()
        self.interval_s = interval_s
        self.device_index = device_index
        self.pid = os.getpid() if pid is None else pid
        self._nvml = nvml
        self._handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._active: set[str] = set()
        self._start_time = time.monotonic()

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
            if self._handle is not None:
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
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception:  # no driver (NVMLError_LibraryNotFound) or no such device: CPU path
            self._handle = None

    def _deliver(self, event: Event) -> None:
        if self.callback is None:
            self.events.put(event)
            return
        with contextlib.suppress(Exception):  # a failing consumer must not kill sampling
            self.callback(event)

    def sample_events(self) -> list[Event]:
        """One sample and the warnings that start with it (also usable without the thread)."""
        try:
            sample = self._sample()
        except Exception:
            return []
        return [sample, *self._warnings(sample)]

    def _sample(self) -> TelemetrySample:
        now = time.monotonic() - self._start_time
        rss = process_rss_bytes()
        if self._handle is None:
            return TelemetrySample(now, None, None, None, None, None, None, None, None, None, None, None, (), rss)
        nvml, handle = self._nvml, self._handle
        memory = safe_read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        rates = safe_read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        milliwatts = safe_read(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        limit = safe_read(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        mask = throttle_mask(nvml, handle) or 0
        return TelemetrySample(
            time_s=now,
            gpu_index=self.device_index,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            process_gpu_memory_bytes=_torch_reserved(self.device_index) or self._process_memory(),
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

    def _process_memory(self) -> int | None:
        """NVML's per-process figure (None on Windows WDDM, where the driver does not report it)."""
        processes = safe_read(lambda: self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)) or []
        for process in processes:
            if getattr(process, "pid", None) == self.pid:
                used = getattr(process, "usedGpuMemory", None)
                return int(used) if used else None
        return None

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
        new = [
            TelemetryWarning(code, message, sample.time_s)
            for code, message in found.items()
            if code not in self._active
        ]
        self._active = set(found)
        return new
