"""Which torch build each GPU and driver gets, and how the driver is read (NVML, then nvidia-smi)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_S

from engine.setup.torch_build import (
    TORCH_REQUIREMENT,
    DriverInfo,
    NvidiaGpu,
    choose_torch_build,
    detect_driver,
    parse_nvidia_smi_banner,
    parse_nvidia_smi_gpus,
)

RTX_4090 = NvidiaGpu("NVIDIA GeForce RTX 4090", (8, 9))
RTX_2080 = NvidiaGpu("NVIDIA GeForce RTX 2080", (7, 5))
RTX_5090 = NvidiaGpu("NVIDIA GeForce RTX 5090", (12, 0))
B200 = NvidiaGpu("NVIDIA B200", (10, 0))
GB10 = NvidiaGpu("NVIDIA GB10", (12, 1))
H100 = NvidiaGpu("NVIDIA H100 80GB HBM3", (9, 0))
V100 = NvidiaGpu("Tesla V100-SXM2-16GB", (7, 0))
GTX_1080 = NvidiaGpu("NVIDIA GeForce GTX 1080", (6, 1))
K80 = NvidiaGpu("Tesla K80", (3, 7))


def driver(cuda: tuple[int, int] | None, *gpus: NvidiaGpu) -> DriverInfo:
    return DriverInfo("999.99", cuda, gpus, "nvml")


# (case, driver, expected build, blocked?, a word every warning/blocked text must contain or "")
CASES: list[tuple[str, DriverInfo, str, bool, str]] = [
    ("no GPU", DriverInfo(None, None, (), "none", "NVML: library not found"), "cpu", False, "CPU"),
    ("driver CUDA 13.0", driver((13, 0), RTX_4090), "cu130", False, ""),
    ("driver CUDA 13.1", driver((13, 1), H100), "cu130", False, ""),
    ("driver CUDA 12.9", driver((12, 9), RTX_4090), "cu128", False, ""),
    ("driver CUDA 12.8", driver((12, 8), RTX_2080), "cu128", False, ""),
    ("driver CUDA 12.6", driver((12, 6), RTX_4090), "cu126", False, ""),
    ("driver CUDA 12.2 (minor-version compatible)", driver((12, 2), RTX_4090), "cu126", False, ""),
    ("driver CUDA 11.8: too old for any build", driver((11, 8), RTX_4090), "cpu", True, "525"),
    ("Volta on a CUDA 13 driver: capped", driver((13, 0), V100), "cu126", False, ""),
    ("Pascal on a CUDA 12.8 driver: capped", driver((12, 8), GTX_1080), "cu126", False, ""),
    ("Turing 7.5 is not capped", driver((13, 0), RTX_2080), "cu130", False, ""),
    ("Kepler: no build has its kernels", driver((12, 4), K80), "cpu", False, "CPU"),
    ("RTX 5090 (sm_120) on CUDA 12.8", driver((12, 8), RTX_5090), "cu128", False, ""),
    ("RTX 5090 on CUDA 13.0", driver((13, 0), RTX_5090), "cu130", False, ""),
    ("RTX 5090 on CUDA 12.6: update the driver", driver((12, 6), RTX_5090), "cpu", True, "570"),
    ("B200 (sm_100) on CUDA 12.4: update the driver", driver((12, 4), B200), "cpu", True, "570"),
    ("GB10 (sm_121) on CUDA 12.7: update the driver", driver((12, 7), GB10), "cpu", True, "570"),
    ("GB10 on CUDA 13.0", driver((13, 0), GB10), "cu130", False, ""),
    ("Blackwell and Volta together: Blackwell wins", driver((12, 8), RTX_5090, V100), "cu128", False, "V100"),
    ("two Ada cards", driver((12, 8), RTX_4090, RTX_4090), "cu128", False, ""),
    ("driver without a CUDA version", driver(None, RTX_4090), "cu126", False, "driver"),
]


@pytest.mark.parametrize(("case", "info", "build", "blocked", "word"), CASES, ids=[c[0] for c in CASES])
def test_choice(case: str, info: DriverInfo, build: str, blocked: bool, word: str) -> None:
    choice = choose_torch_build(info)
    assert choice.build == build, case
    assert (choice.blocked is not None) == blocked
    if blocked:
        assert "Update your NVIDIA driver to at least" in (choice.blocked or "")
    if word:
        assert any(word in text for text in choice.warnings), choice.warnings
    assert choice.index_url == f"https://download.pytorch.org/whl/{build}"


# (override, driver, expected warnings containing)
OVERRIDES: list[tuple[str, DriverInfo, tuple[str, ...]]] = [
    ("cpu", driver((12, 8), RTX_4090), ("automatic choice would be cu128",)),
    ("cu128", driver((12, 8), RTX_4090), ()),
    ("cu130", driver((12, 8), RTX_4090), ("will not start", "automatic choice would be cu128")),
    ("cu126", driver((13, 0), RTX_5090), ("automatic choice would be cu130",)),
    ("cu128", DriverInfo(None, None, (), "none"), ("No NVIDIA GPU", "automatic choice would be cpu")),
    ("cpu", DriverInfo(None, None, (), "none"), ()),
]


@pytest.mark.parametrize(("override", "info", "expected"), OVERRIDES)
def test_override(override: str, info: DriverInfo, expected: tuple[str, ...]) -> None:
    choice = choose_torch_build(info, override)
    assert (choice.build, choice.overridden, choice.blocked) == (override, True, None)
    assert len(choice.warnings) == len(expected)
    for text, warning in zip(expected, choice.warnings, strict=True):
        assert text in warning


def test_unknown_override_is_refused() -> None:
    with pytest.raises(ValueError, match="cu999"):
        choose_torch_build(driver((12, 8), RTX_4090), "cu999")


OLD_BANNER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.16              Driver Version: 570.86.16      CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
"""
NEW_BANNER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.65.06     Driver Version: 580.65.06     CUDA UMD Version: 13.0           |
+-----------------------------------------------------------------------------------------+
"""
WINDOWS_BANNER = "| NVIDIA-SMI 576.02    Driver Version: 576.02    CUDA Version: 12.9  |"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (OLD_BANNER, ("570.86.16", (12, 8))),
        (NEW_BANNER, ("580.65.06", (13, 0))),
        (WINDOWS_BANNER, ("576.02", (12, 9))),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", (None, None)),
    ],
)
def test_nvidia_smi_banner(text: str, expected: tuple[str | None, tuple[int, int] | None]) -> None:
    assert parse_nvidia_smi_banner(text) == expected


def test_nvidia_smi_gpu_list() -> None:
    text = "NVIDIA GeForce RTX 5090, 12.0\nNVIDIA RTX A6000, 8.6\nSome, Odd GPU, [N/A]\n"
    assert parse_nvidia_smi_gpus(text) == (
        NvidiaGpu("NVIDIA GeForce RTX 5090", (12, 0)),
        NvidiaGpu("NVIDIA RTX A6000", (8, 6)),
        NvidiaGpu("Some, Odd GPU", None),
    )


class FakeNvml:
    def __init__(self, cuda: int, gpus: list[tuple[str, tuple[int, int]]]) -> None:
        self.cuda, self.gpus, self.shut_down = cuda, gpus, False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"580.65.06"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.gpus[handle][0]

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return self.gpus[handle][1]


def no_nvml() -> Any:
    raise ImportError("libnvidia-ml.so.1: cannot open shared object file")


def fake_smi(outputs: dict[str, str]) -> Any:
    def run(argv: list[str]) -> str:
        key = "query" if len(argv) > 1 else "banner"
        if key not in outputs:
            raise FileNotFoundError("nvidia-smi not found")
        return outputs[key]

    return run


def test_detect_reads_nvml_first() -> None:
    nvml = FakeNvml(13000, [("NVIDIA GeForce RTX 5090", (12, 0))])
    info = detect_driver(lambda: nvml, fake_smi({}))
    assert info == DriverInfo("580.65.06", (13, 0), (NvidiaGpu("NVIDIA GeForce RTX 5090", (12, 0)),), "nvml")
    assert nvml.shut_down
    assert detect_driver(lambda: FakeNvml(12080, []), fake_smi({})).cuda_version == (12, 8)


def test_detect_falls_back_to_nvidia_smi() -> None:
    info = detect_driver(no_nvml, fake_smi({"banner": NEW_BANNER, "query": "NVIDIA GB10, 12.1\n"}))
    assert (info.source, info.cuda_version, info.gpus) == ("nvidia-smi", (13, 0), (NvidiaGpu("NVIDIA GB10", (12, 1)),))
    assert choose_torch_build(info).build == "cu130"


def test_detect_without_driver_says_why() -> None:
    info = detect_driver(no_nvml, fake_smi({}))
    assert (info.source, info.gpus, info.cuda_version) == ("none", (), None)
    assert "libnvidia-ml" in info.note and "nvidia-smi" in info.note
    assert choose_torch_build(info).build == "cpu"


def test_detect_on_this_machine_never_raises() -> None:
    info = detect_driver()
    assert info.source in ("nvml", "nvidia-smi", "none")


def test_torch_range_matches_pyproject() -> None:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert TORCH_REQUIREMENT in [dep.replace(" ", "") for dep in project["dependencies"]]


def test_setup_modules_do_not_import_torch_or_qt() -> None:
    code = (
        "import sys, engine.setup.commands, engine.setup.environment, engine.setup.wheelhouse\n"
        "from engine.setup.commands import setup_main\n"
        "setup_main(['detect'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'PySide6', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    assert "torch build: cpu" in result.stdout
