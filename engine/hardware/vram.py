"""One measure of a training step's memory peak: what the process holds, not only what its tensors use.

``torch.cuda.max_memory_allocated`` counts the bytes of live tensors. With step graphs (CUDA graphs) a replayed
graph's memory pool stays *reserved* between replays but is not *allocated* then, so that counter misses it: the
bench read 2.60 GiB for a Llama-3.2-1B 16,384-token row while 78.9 GiB was reserved. The true peak is the caching
allocator's peak reserved bytes (step-graph pools and cached free blocks included, never below the allocated
peak): memory no other process and no later allocation outside the allocator can use. Beside it stands the
driver's view through NVML, this process's GPU memory with the CUDA context, where the driver tells it; it is
None where NVML is missing, not permitted (a container with its own process ids, Windows WDDM) or fails. On the
CPU the measure is the process's resident memory.

    reset_step_peak(device)          # before the step
    peak = read_step_peak(device)    # after it: peak.true_peak, peak.allocated, peak.driver
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

NOT_AVAILABLE = 1 << 63
"""NVML reports "not available" as the largest unsigned 64-bit value; any figure this large is no figure."""


@dataclass(frozen=True)
class MemoryPeak:
    """A step's memory peak, in bytes."""

    reserved: int
    """The allocator's peak reserved bytes since the last reset (on the CPU: the process's resident memory)."""
    allocated: int
    """The allocator's peak bytes in live tensors since the last reset (on the CPU: as ``reserved``)."""
    driver: int | None = None
    """This process's GPU memory as the driver (NVML) reports it, CUDA context included; None where unavailable."""

    @property
    def true_peak(self) -> int:
        """What the step held at most: the reserved peak, which counts step-graph pools and cached blocks."""
        return max(self.reserved, self.allocated)


def reset_step_peak(device: torch.device) -> None:
    """Start a new step's peak (nothing to reset on the CPU, whose measure is the resident memory now)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def read_step_peak(device: torch.device, driver: bool = True) -> MemoryPeak:
    """The peak since :func:`reset_step_peak`; ``driver=False`` leaves out the NVML reading (one driver call)."""
    if device.type != "cuda":
        resident = process_resident_bytes()
        return MemoryPeak(resident, resident)
    reserved = int(torch.cuda.max_memory_reserved(device))
    allocated = int(torch.cuda.max_memory_allocated(device))
    return MemoryPeak(reserved, allocated, driver_bytes(device) if driver else None)


def process_resident_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def driver_bytes(device: torch.device) -> int | None:
    """This process's memory on ``device`` as NVML reports it now (one driver call; the device's handle is looked up
    once per process), or None where NVML cannot tell. The caching allocator rarely returns memory to the driver,
    so this figure read after a step is close to the most the process held on the card so far."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _nvml_handle(index)
    if handle is None:
        return None
    try:
        import pynvml

        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # pynvml.NVMLError (not permitted, driver gone) or anything else: no figure, never a failure
        return None
    pid = os.getpid()
    used = next((getattr(p, "usedGpuMemory", None) for p in processes if getattr(p, "pid", None) == pid), None)
    return int(used) if used and 0 < int(used) < NOT_AVAILABLE else None


@functools.cache
def _nvml_handle(index: int) -> Any | None:
    """NVML's handle of torch's CUDA device ``index``, matched by UUID (torch's order and NVML's differ under
    ``CUDA_VISIBLE_DEVICES``); None without pynvml or a driver, or where NVML refuses."""
    try:
        import pynvml

        pynvml.nvmlInit()  # counted by NVML: a telemetry sampler's nvmlShutdown leaves this one open
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
        if not uuid:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # ImportError, pynvml.NVMLError (no driver, not permitted) or anything else: no driver view
        return None
