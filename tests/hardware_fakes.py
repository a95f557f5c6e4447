"""Fake nvidia-ml-py and torch modules describing any GPU, for detection and telemetry tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

GIB = 1 << 30


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str
    cc: tuple[int, int]
    vram_gib: float
    sms: int
    integrated: bool = False
    used_gib: float = 0.4
    throttle_mask: int = 0
    temperature: float = 55.0
    processes: list[Any] = field(default_factory=list)
    memory_info_supported: bool = True

    @property
    def uuid(self) -> str:
        return f"GPU-{abs(hash(self.name)) % 10**8:08d}-0000"


class FakeNvml:
    """The subset of pynvml that TuneDeck calls; ``missing_library`` raises like a machine without a driver."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu], missing_library: bool = False) -> None:
        self.gpus = gpus
        self.missing_library = missing_library
        self.initialised = 0

    def nvmlInit(self) -> None:
        if self.missing_library:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> bytes:
        return gpu.name.encode()

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu.uuid

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        if not gpu.memory_info_supported:
            raise FakeNVMLError("Not Supported")
        total = int(gpu.vram_gib * GIB)
        used = int(gpu.used_gib * GIB)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, gpu: FakeGpu) -> tuple[int, int]:
        return gpu.cc

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        return 120_000

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int:
        return 300_000

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        return int(gpu.temperature)

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock: int) -> int:
        return 1800 if clock == 1 else 9001

    def nvmlDeviceGetMaxClockInfo(self, gpu: FakeGpu, clock: int) -> int:
        return 2500

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        return gpu.throttle_mask

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(gpu=97, memory=60)

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        return gpu.processes


def fake_torch(gpus: list[FakeGpu], *, cuda_build: str | None = "13.0") -> Any:
    """A torch whose CUDA sees ``gpus`` (an empty list: CPU-only build or no usable GPU)."""

    def props(index: int) -> Any:
        gpu = gpus[index]
        return SimpleNamespace(
            name=gpu.name,
            major=gpu.cc[0],
            minor=gpu.cc[1],
            total_memory=int(gpu.vram_gib * GIB),
            multi_processor_count=gpu.sms,
            is_integrated=gpu.integrated,
            uuid=gpu.uuid.removeprefix("GPU-"),
        )

    cuda = SimpleNamespace(
        is_available=lambda: bool(gpus) and cuda_build is not None,
        device_count=lambda: len(gpus),
        get_device_properties=props,
    )
    return SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda=cuda_build), cuda=cuda)
