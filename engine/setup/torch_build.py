"""Which CUDA build of torch fits this machine's GPU and driver.

torch publishes one wheel per CUDA toolkit (cu126, cu128, cu130, cpu). A wheel works only when the driver
supports its CUDA version and the wheel carries kernels for the GPU: the wrong pick is the most common installer
failure elsewhere (RTX 50 cards on a cu126 build fail with "no kernel image is available"). The rules:

* driver CUDA >= 13.0 -> cu130, >= 12.8 -> cu128, 12.x -> cu126 (CUDA minor-version compatibility covers 12.0-12.5);
  a driver older than CUDA 12 runs none of them: the user is told to update it;
* compute capability below 7.5 (Pascal, Volta) is capped at cu126: the cu128/cu130 wheels dropped those kernels;
* Blackwell (sm_100/103/110/120/121) has kernels only from cu128 on: with an older driver the user is told which
  driver to install instead of getting a build that cannot run;
* no NVIDIA GPU -> the CPU build, with a warning that training will be slow.

The driver is read with nvidia-ml-py; where NVML is missing or fails, ``nvidia-smi``'s output is parsed (its
banner says "CUDA Version: 12.8" on older drivers and "CUDA UMD Version: 13.0" on newer ones).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUILDS = ("cu130", "cu128", "cu126", "cpu")
INDEX_URL = "https://download.pytorch.org/whl/{build}"
TORCH_REQUIREMENT = "torch>=2.11,<2.15"
"""The range pyproject.toml accepts; kept equal to it (tests/test_torch_build.py checks)."""

MIN_DRIVER_FOR_CUDA = {(13, 0): "580", (12, 8): "570", (12, 0): "525"}
"""The first driver branch that supports each CUDA version (NVIDIA's CUDA release notes)."""

DOWNLOAD_BYTES = {"cu130": 3_300_000_000, "cu128": 3_600_000_000, "cu126": 3_200_000_000, "cpu": 200_000_000}
"""About how much one torch build downloads with its CUDA libraries (torch 2.13, x86-64)."""

INSTALLED_BYTES = {"cu130": 6_500_000_000, "cu128": 7_000_000_000, "cu126": 6_200_000_000, "cpu": 800_000_000}
"""About how much room one torch build takes installed (its cache copy shares the drive and the files)."""


@dataclass(frozen=True)
class NvidiaGpu:
    """One GPU as the driver reports it."""

    name: str
    compute_capability: tuple[int, int] | None

    @property
    def is_blackwell(self) -> bool:
        return self.compute_capability is not None and self.compute_capability[0] >= 10

    @property
    def sm(self) -> str:
        return "sm_?" if self.compute_capability is None else "sm_{}{}".format(*self.compute_capability)


@dataclass(frozen=True)
class DriverInfo:
    """What the NVIDIA driver says about itself and its GPUs; ``source`` is how it was read."""

    driver_version: str | None
    cuda_version: tuple[int, int] | None
    gpus: tuple[NvidiaGpu, ...]
    source: str  # "nvml", "nvidia-smi" or "none"
    note: str = ""

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


@dataclass(frozen=True)
class TorchChoice:
    """The torch build to install, why, and what the user must know.

    ``blocked`` is set when no build can use the GPU until the user acts (an old driver); ``build`` is then the
    best build to fall back to (CPU), installed only if the user accepts.
    """

    build: str
    reason: str
    warnings: tuple[str, ...] = ()
    blocked: str | None = None
    overridden: bool = False

    @property
    def index_url(self) -> str:
        return INDEX_URL.format(build=self.build)

    @property
    def requirement(self) -> str:
        return TORCH_REQUIREMENT

    @property
    def download_bytes(self) -> int:
        return DOWNLOAD_BYTES[self.build]

    @property
    def installed_bytes(self) -> int:
        return INSTALLED_BYTES[self.build]


# ------------------------------------------------------------------------------------------------- selection


def build_for_cuda(cuda: tuple[int, int]) -> str:
    if cuda >= (13, 0):
        return "cu130"
    if cuda >= (12, 8):
        return "cu128"
    return "cu126"


def _cuda_text(cuda: tuple[int, int]) -> str:
    return f"{cuda[0]}.{cuda[1]}"


def choose_torch_build(driver: DriverInfo, override: str | None = None) -> TorchChoice:
    """The torch build for ``driver``'s GPUs; ``override`` (one of BUILDS) wins, with a warning if it won't run."""
    if override is not None:
        return _overridden(driver, override)
    if not driver.has_gpu:
        return TorchChoice(
            "cpu",
            "no NVIDIA GPU found" + (f" ({driver.note})" if driver.note else ""),
            ("Training will run on the CPU: fine for the demo, far too slow for real models.",),
        )
    if driver.cuda_version is None:
        warning = "Could not read the driver's CUDA version; if torch fails to start, update the driver."
        return TorchChoice("cu126", "the driver did not report its CUDA version; cu126 runs most widely", (warning,))
    return _choose_for_gpus(driver.gpus, driver.cuda_version)


def _choose_for_gpus(gpus: tuple[NvidiaGpu, ...], cuda: tuple[int, int]) -> TorchChoice:
    blackwell = [gpu for gpu in gpus if gpu.is_blackwell]
    known = [gpu.compute_capability for gpu in gpus if gpu.compute_capability is not None]
    oldest = min(known) if known else None
    if cuda < (12, 0):
        return _driver_too_old(gpus, cuda, (12, 0), "cpu")
    if blackwell and cuda < (12, 8):
        return _driver_too_old(blackwell, cuda, (12, 8), "cpu")
    if oldest is not None and oldest < (5, 0):
        return TorchChoice("cpu", f"the GPU's compute capability {oldest[0]}.{oldest[1]} is older than torch supports",
                           ("No current torch build runs on this GPU; training will use the CPU.",))  # fmt: skip
    build = build_for_cuda(cuda)
    reason = f"driver supports CUDA {_cuda_text(cuda)}"
    warnings: list[str] = []
    if oldest is not None and oldest < (7, 5) and build != "cu126":
        if blackwell:
            old = ", ".join(
                f"{g.name} ({g.sm})" for g in gpus if g.compute_capability and g.compute_capability < (7, 5)
            )
            warnings.append(f"{old} cannot be used by the {build} build the Blackwell GPU needs.")
        else:
            reason += f"; compute capability {oldest[0]}.{oldest[1]} is below 7.5, which newer builds dropped"
            build = "cu126"
    return TorchChoice(build, reason, tuple(warnings))


def _driver_too_old(gpus: list[NvidiaGpu] | tuple[NvidiaGpu, ...], cuda: tuple[int, int],
                    needed: tuple[int, int], fallback: str) -> TorchChoice:  # fmt: skip
    names = ", ".join(f"{gpu.name} ({gpu.sm})" for gpu in gpus)
    message = (
        f"Update your NVIDIA driver to at least version {MIN_DRIVER_FOR_CUDA[needed]} "
        f"(CUDA {_cuda_text(needed)}): the installed driver supports CUDA {_cuda_text(cuda)}, "
        f"too old for {names}. Then run setup again."
    )
    return TorchChoice(fallback, f"driver supports only CUDA {_cuda_text(cuda)}", (message,), blocked=message)


def _overridden(driver: DriverInfo, override: str) -> TorchChoice:
    if override not in BUILDS:
        raise ValueError(f"unknown torch build {override!r}: choose one of {', '.join(BUILDS)}")
    automatic = choose_torch_build(driver)
    warnings: list[str] = []
    if override != "cpu" and not driver.has_gpu:
        warnings.append(f"No NVIDIA GPU was found: the {override} build will run on the CPU only.")
    elif override != "cpu" and driver.cuda_version is not None:
        newest = build_for_cuda(driver.cuda_version)
        if driver.cuda_version < (12, 0) or BUILDS.index(override) < BUILDS.index(newest):
            warnings.append(f"The driver supports CUDA {_cuda_text(driver.cuda_version)}: {override} will not start.")
    if override != automatic.build:
        warnings.append(f"The automatic choice would be {automatic.build} ({automatic.reason}).")
    return TorchChoice(override, "chosen by you", tuple(warnings), overridden=True)


# ------------------------------------------------------------------------------------------------- detection

_CUDA_BANNER = re.compile(r"CUDA(?: UMD)? Version\s*:\s*(\d+)\.(\d+)")
_DRIVER_BANNER = re.compile(r"Driver Version\s*:\s*([0-9.]+)")

Runner = Callable[[list[str]], str]


def parse_nvidia_smi_banner(text: str) -> tuple[str | None, tuple[int, int] | None]:
    """(driver version, CUDA version) from ``nvidia-smi``'s banner, in both its old and new wording."""
    cuda = _CUDA_BANNER.search(text)
    driver = _DRIVER_BANNER.search(text)
    return (driver.group(1) if driver else None, (int(cuda.group(1)), int(cuda.group(2))) if cuda else None)


def parse_nvidia_smi_gpus(csv_text: str) -> tuple[NvidiaGpu, ...]:
    """GPUs from ``nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader``."""
    gpus = []
    for line in csv_text.strip().splitlines():
        name, _, cap = line.rpartition(",")
        match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", cap)
        if not name.strip():
            continue
        gpus.append(NvidiaGpu(name.strip(), (int(match.group(1)), int(match.group(2))) if match else None))
    return tuple(gpus)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(nvml: Any) -> DriverInfo:
    """Read the driver through an initialised-on-demand NVML module (``pynvml``); raises if NVML fails."""
    nvml.nvmlInit()
    try:
        version = int(nvml.nvmlSystemGetCudaDriverVersion_v2())  # 12080 means 12.8
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(NvidiaGpu(_text(nvml.nvmlDeviceGetName(handle)), (int(major), int(minor))))
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        return DriverInfo(driver, (version // 1000, version % 1000 // 10), tuple(gpus), "nvml")
    finally:
        nvml.nvmlShutdown()


def read_nvidia_smi(run: Runner) -> DriverInfo:
    driver, cuda = parse_nvidia_smi_banner(run(["nvidia-smi"]))
    gpus = parse_nvidia_smi_gpus(run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]))
    return DriverInfo(driver, cuda, gpus, "nvidia-smi")


def _run_command(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(f"{argv[0]} not found")
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def _import_nvml() -> Any:
    import pynvml  # nvidia-ml-py; installed with TuneDeck, before torch

    return pynvml


def detect_driver(nvml: Callable[[], Any] = _import_nvml, run: Runner = _run_command) -> DriverInfo:
    """The NVIDIA driver and GPUs: NVML first, then ``nvidia-smi``; never raises."""
    notes = []
    try:
        return read_nvml(nvml())
    except Exception as err:  # pynvml.NVMLError_LibraryNotFound without a driver, ImportError without the module
        notes.append(f"NVML: {type(err).__name__}: {err}".rstrip(": "))
    try:
        info = read_nvidia_smi(run)
        if info.gpus or info.cuda_version:
            return info
        notes.append("nvidia-smi listed no GPU")
    except (OSError, subprocess.SubprocessError) as err:
        notes.append(f"nvidia-smi: {err}")
    return DriverInfo(None, None, (), "none", "; ".join(notes))


def describe(driver: DriverInfo, choice: TorchChoice) -> list[str]:
    """Lines for a person: the GPUs, the driver, the chosen build, warnings."""
    lines = [f"GPU: {gpu.name} ({gpu.sm})" for gpu in driver.gpus] or ["GPU: no NVIDIA GPU found"]
    if driver.driver_version or driver.cuda_version:
        cuda = _cuda_text(driver.cuda_version) if driver.cuda_version else "unknown"
        lines.append(f"Driver: {driver.driver_version or 'unknown'} (CUDA {cuda}, read with {driver.source})")
    lines.append(f"torch build: {choice.build} ({choice.reason})")
    lines.append(
        f"Download: about {choice.download_bytes / 1e9:.1f} GB, disk: about {choice.installed_bytes / 1e9:.1f} GB"
    )
    lines += [f"warning: {text}" for text in choice.warnings]
    return lines
