"""What the machine is: GPUs (from nvidia-ml-py and torch), their class, and the CPU fallback.

Detection never fails: without an NVIDIA driver (``nvmlInit`` raises ``NVMLError_LibraryNotFound``), without a
GPU, or with a CPU-only torch build it reports what it could read and the CPU path, with a note saying why.
NVML gives what torch cannot (driver, the driver's CUDA version, power, temperature, clocks, throttle reasons);
torch gives what NVML cannot (SM count, integrated memory, whether this torch can use the GPU at all).
Both modules are passed in by tests, so every card can be faked.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.hardware import gpus
from engine.hardware.gpus import find_gpu

T = TypeVar("T")

THROTTLE_REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
SERIOUS_THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80
"""Thermal and hardware slowdowns: the card runs well below its clocks (a power cap under load is normal)."""

ARCHITECTURES = {
    (7, 0): "Volta", (7, 2): "Volta", (7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Ampere",
    (8, 9): "Ada Lovelace", (9, 0): "Hopper", (10, 0): "Blackwell", (10, 3): "Blackwell", (11, 0): "Blackwell",
    (12, 0): "Blackwell", (12, 1): "Blackwell",
}  # fmt: skip

_WORKSTATION_MARKERS = ("rtx a", "rtx pro", "quadro", " ada generation", "rtx 2000 ada", "rtx 4000 ada",
                        "rtx 4500 ada", "rtx 5000 ada", "rtx 6000 ada")  # fmt: skip
_AMPERE_DATACENTER = ("a100", "a30", "a10", "a40", "a16", "a2 ", "a800")


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU as detected. Fields NVML or torch could not read are None."""

    index: int
    name: str
    compute_capability: tuple[int, int] | None
    total_memory_bytes: int | None
    used_memory_bytes: int | None = None
    sm_count: int | None = None
    integrated: bool = False
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    usable_by_torch: bool = False

    @property
    def architecture(self) -> str:
        return ARCHITECTURES.get(self.compute_capability or (0, 0), "unknown")

    @property
    def gpu_class(self) -> str:
        return classify(self.name, self.compute_capability, self.integrated)

    @property
    def supports_bf16(self) -> bool:
        return (self.compute_capability or (0, 0)) >= (8, 0)


@dataclass(frozen=True)
class HardwareInfo:
    """The machine: its GPUs, the software that drives them, and notes on anything that could not be read."""

    gpus: tuple[GpuInfo, ...]
    driver_version: str | None
    cuda_driver_version: str | None
    torch_version: str | None
    torch_cuda_version: str | None
    platform: str
    wsl: bool
    cpu_count: int
    host_memory_bytes: int | None
    notes: tuple[str, ...] = ()

    @property
    def primary(self) -> GpuInfo | None:
        """The GPU training will use (the first torch can use), or None for the CPU path."""
        return next((gpu for gpu in self.gpus if gpu.usable_by_torch), None)

    @property
    def gpu_class(self) -> str:
        gpu = self.primary
        return gpu.gpu_class if gpu else gpus.CPU

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        for gpu, info in zip(raw["gpus"], self.gpus, strict=True):
            gpu.update(gpu_class=info.gpu_class, architecture=info.architecture)
        raw["gpu_class"] = self.gpu_class
        return raw


def classify(name: str, compute_capability: tuple[int, int] | None, integrated: bool = False) -> str:
    """The TuneDeck class of a GPU from its name, compute capability and memory kind."""
    lower = f" {name.lower()} "
    cc = compute_capability or (0, 0)
    if cc == (12, 1) or "gb10" in lower or (integrated and cc >= (12, 0)):
        return gpus.DGX_SPARK
    if cc in ((10, 0), (10, 3)):
        return gpus.BLACKWELL_DATACENTER
    if cc == (9, 0):
        return gpus.HOPPER
    if any(marker in lower for marker in _WORKSTATION_MARKERS):
        return gpus.RTX_WORKSTATION
    if cc == (8, 0) or any(f" {m.strip()} " in lower or f" {m.strip()}-" in lower for m in _AMPERE_DATACENTER):
        return gpus.AMPERE_DATACENTER
    if ("geforce" in lower or " rtx " in lower) and cc in ((7, 5), (8, 6), (8, 9), (12, 0)):
        return gpus.RTX_CONSUMER
    return gpus.OTHER_NVIDIA


def safe_read(fn: Callable[..., T], default: T | None = None) -> T | None:
    """``fn()``, or ``default`` where it raises. ``fn`` takes no arguments; ``...`` lets it be a lambda whose
    default arguments bind loop variables, which mypy cannot match to ``Callable[[], T]``."""
    try:
        return fn()
    except Exception:  # NVML raises NotSupported/Unknown per field on many cards; one field never stops detection
        return default


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    return tuple(label for bit, label in THROTTLE_REASONS.items() if mask & bit)


def throttle_mask(nvml: Any, handle: Any) -> int | None:
    for getter in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        fn = getattr(nvml, getter, None)
        if fn is not None:
            mask = safe_read(lambda fn=fn: int(fn(handle)))
            if mask is not None:
                return mask
    return None


def read_nvml_device(nvml: Any, index: int) -> dict[str, Any]:
    """Everything NVML tells about device ``index`` (missing fields left out)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = safe_read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    cc = safe_read(lambda: tuple(int(x) for x in nvml.nvmlDeviceGetCudaComputeCapability(handle)))
    mask = throttle_mask(nvml, handle)
    milliwatts = safe_read(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = safe_read(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    fields = {
        "name": safe_read(lambda: _text(nvml.nvmlDeviceGetName(handle))),
        "uuid": safe_read(lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        "compute_capability": cc,
        "total_memory_bytes": int(memory.total) if memory is not None else None,
        "used_memory_bytes": int(memory.used) if memory is not None else None,
        "power_w": milliwatts / 1000 if milliwatts is not None else None,
        "power_limit_w": limit / 1000 if limit is not None else None,
        "temperature_c": safe_read(lambda: float(nvml.nvmlDeviceGetTemperature(handle, 0))),
        "sm_clock_mhz": safe_read(lambda: int(nvml.nvmlDeviceGetClockInfo(handle, 1))),
        "max_sm_clock_mhz": safe_read(lambda: int(nvml.nvmlDeviceGetMaxClockInfo(handle, 1))),
        "memory_clock_mhz": safe_read(lambda: int(nvml.nvmlDeviceGetClockInfo(handle, 2))),
        "throttle_reasons": decode_throttle_reasons(mask) if mask is not None else (),
    }
    return {key: value for key, value in fields.items() if value is not None}


def _nvml_devices(nvml: Any, notes: list[str]) -> tuple[list[dict[str, Any]], str | None, str | None]:
    if nvml is None:
        notes.append("nvidia-ml-py is not installed: no driver, power or temperature readings")
        return [], None, None
    try:
        nvml.nvmlInit()
    except Exception as err:  # pynvml.NVMLError_LibraryNotFound without a driver
        notes.append(f"no NVIDIA driver found ({type(err).__name__})")
        return [], None, None
    try:
        driver = safe_read(lambda: _text(nvml.nvmlSystemGetDriverVersion()))
        cuda = safe_read(lambda: int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None
        count = safe_read(lambda: int(nvml.nvmlDeviceGetCount()), 0) or 0
        devices = [device for i in range(count) if (device := safe_read(lambda i=i: read_nvml_device(nvml, i)))]
        return devices, driver, cuda_text
    finally:
        safe_read(nvml.nvmlShutdown)


def _torch_devices(torch: Any, notes: list[str]) -> tuple[list[dict[str, Any]], str | None, str | None]:
    if torch is None:
        notes.append("torch is not installed")
        return [], None, None
    version = str(getattr(torch, "__version__", "unknown"))
    cuda_build = getattr(getattr(torch, "version", None), "cuda", None)
    if not safe_read(lambda: bool(torch.cuda.is_available()), False):
        return [], version, cuda_build
    devices = []
    for index in range(safe_read(lambda: int(torch.cuda.device_count()), 0) or 0):
        props = safe_read(lambda index=index: torch.cuda.get_device_properties(index))
        if props is None:
            continue
        devices.append({
            "name": str(props.name),
            "uuid": str(getattr(props, "uuid", "") or ""),
            "compute_capability": (int(props.major), int(props.minor)),
            "total_memory_bytes": int(props.total_memory),
            "sm_count": int(getattr(props, "multi_processor_count", 0)) or None,
            "integrated": bool(getattr(props, "is_integrated", False)),
        })  # fmt: skip
    return devices, version, cuda_build


def _same_device(nvml_device: dict[str, Any], torch_device: dict[str, Any]) -> bool:
    a = str(nvml_device.get("uuid", "")).removeprefix("GPU-").lower()
    b = str(torch_device.get("uuid", "")).removeprefix("GPU-").lower()
    return bool(a) and a == b


def _merge(nvml_devices: list[dict[str, Any]], torch_devices: list[dict[str, Any]]) -> list[GpuInfo]:
    """torch's devices in torch's order (what training uses), completed with NVML's readings; then GPUs only
    NVML sees (a CPU-only torch, or CUDA_VISIBLE_DEVICES hiding them)."""
    used: set[int] = set()
    merged: list[GpuInfo] = []
    for index, torch_device in enumerate(torch_devices):
        match = next((i for i, d in enumerate(nvml_devices) if i not in used and _same_device(d, torch_device)), None)
        if match is None and len(nvml_devices) == len(torch_devices) and index not in used:
            match = index
        nvml_device = nvml_devices[match] if match is not None else {}
        if match is not None:
            used.add(match)
        merged.append(_gpu_info(index, {**nvml_device, **torch_device}, usable=True))
    for i, nvml_device in enumerate(nvml_devices):
        if i not in used:
            merged.append(_gpu_info(len(merged), nvml_device, usable=False))
    return merged


def _gpu_info(index: int, fields: dict[str, Any], usable: bool) -> GpuInfo:
    name = str(fields.get("name") or "unknown NVIDIA GPU")
    spec = find_gpu(name)
    cc = fields.get("compute_capability") or (spec.compute_capability if spec else None)
    integrated = bool(fields.get("integrated") or (spec.unified_memory if spec else False))
    known = {f.name for f in dataclasses.fields(GpuInfo)}
    values = {k: v for k, v in fields.items() if k in known}
    values.update(index=index, name=name, compute_capability=cc, integrated=integrated, usable_by_torch=usable)
    values.setdefault("total_memory_bytes", None)
    return GpuInfo(**values)


def running_under_wsl() -> bool:
    try:
        with open("/proc/version", encoding="utf-8") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def host_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:  # Windows
        import ctypes

        class MemoryStatus(ctypes.Structure):
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong)] + [
                (name, ctypes.c_ulonglong)
                for name in ("total", "avail", "page_total", "page_avail", "virtual_total", "virtual_avail", "ext")
            ]

        status = MemoryStatus()
        status.length = ctypes.sizeof(MemoryStatus)
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined]
            return int(status.total)
    except Exception:
        pass
    return None


def _import_or_none(name: str) -> Any:
    try:
        return __import__(name)
    except Exception:  # a broken CUDA install can raise more than ImportError
        return None


def detect_hardware(nvml: Any = ..., torch: Any = ...) -> HardwareInfo:
    """Read the machine. ``nvml``/``torch`` default to the real modules (None: act as if not installed)."""
    nvml = _import_or_none("pynvml") if nvml is ... else nvml
    torch = _import_or_none("torch") if torch is ... else torch
    notes: list[str] = []
    nvml_devices, driver, cuda_driver = _nvml_devices(nvml, notes)
    torch_devices, torch_version, torch_cuda = _torch_devices(torch, notes)
    merged = _merge(nvml_devices, torch_devices)
    if nvml_devices and not torch_devices and torch is not None:
        build = "a CPU-only torch" if not torch_cuda else f"torch built for CUDA {torch_cuda}, which cannot use it"
        notes.append(f"an NVIDIA GPU is present but this is {build}: training would run on the CPU")
    if not merged:
        notes.append("no NVIDIA GPU: training runs on the CPU (slow; fine for tiny models and tests)")
    return HardwareInfo(
        gpus=tuple(merged),
        driver_version=driver,
        cuda_driver_version=cuda_driver,
        torch_version=torch_version,
        torch_cuda_version=torch_cuda,
        platform=f"{platform.system()} {platform.release()}".strip(),
        wsl=running_under_wsl(),
        cpu_count=os.cpu_count() or 1,
        host_memory_bytes=host_memory_bytes(),
        notes=tuple(notes),
    )
