"""Detection, classification and the profile for a table of real cards, with NVML and torch faked."""

from __future__ import annotations

import json

import pytest

from engine.hardware import gpus
from engine.hardware.detect import classify, detect_hardware
from engine.hardware.planner import SAFETY_MARGIN, MemoryPlan
from engine.hardware.profile import DeviceTarget, build_profile
from engine.hardware.shapes import load_shape
from tests.hardware_fakes import FakeGpu, FakeNvml, fake_torch

CARDS = [
    # nvml name, cc, GiB, SMs, integrated, class, dtype, attention
    ("NVIDIA GeForce RTX 2080 Ti", (7, 5), 11, 68, False, gpus.RTX_CONSUMER, "float16", "sdpa"),
    ("NVIDIA GeForce RTX 3060 Laptop GPU", (8, 6), 6, 30, False, gpus.RTX_CONSUMER, "bfloat16", "varlen"),
    ("NVIDIA GeForce RTX 3090", (8, 6), 24, 82, False, gpus.RTX_CONSUMER, "bfloat16", "varlen"),
    ("NVIDIA GeForce RTX 4060 Laptop GPU", (8, 9), 8, 24, False, gpus.RTX_CONSUMER, "bfloat16", "varlen"),
    ("NVIDIA GeForce RTX 4090", (8, 9), 24, 128, False, gpus.RTX_CONSUMER, "bfloat16", "varlen"),
    ("NVIDIA GeForce RTX 5090", (12, 0), 32, 170, False, gpus.RTX_CONSUMER, "bfloat16", "varlen"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 96, 188, False, gpus.RTX_WORKSTATION, "bfloat16",
     "varlen"),
    ("Tesla T4", (7, 5), 15, 40, False, gpus.OTHER_NVIDIA, "float16", "sdpa"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 80, 108, False, gpus.AMPERE_DATACENTER, "bfloat16", "varlen"),
    ("NVIDIA H200", (9, 0), 140, 132, False, gpus.HOPPER, "bfloat16", "varlen"),
    ("NVIDIA B200", (10, 0), 179, 148, False, gpus.BLACKWELL_DATACENTER, "bfloat16", "varlen"),
    ("NVIDIA GB10", (12, 1), 120, 48, True, gpus.DGX_SPARK, "bfloat16", "varlen"),
]  # fmt: skip
IDS = [card[0] for card in CARDS]


def detect_one(name: str, cc: tuple[int, int], vram: float, sms: int, integrated: bool):  # type: ignore[no-untyped-def]
    gpu = FakeGpu(name, cc, vram, sms, integrated=integrated, memory_info_supported=not integrated)
    return detect_hardware(nvml=FakeNvml([gpu]), torch=fake_torch([gpu]))


@pytest.mark.parametrize(("name", "cc", "vram", "sms", "integrated", "cls", "dtype", "attention"), CARDS, ids=IDS)
def test_detects_class_and_fields(name, cc, vram, sms, integrated, cls, dtype, attention) -> None:  # type: ignore[no-untyped-def]
    hardware = detect_one(name, cc, vram, sms, integrated)
    gpu = hardware.primary
    assert gpu is not None and gpu.name == name
    assert gpu.compute_capability == cc and gpu.sm_count == sms and gpu.integrated == integrated
    assert gpu.total_memory_bytes == int(vram * (1 << 30))
    assert hardware.gpu_class == cls
    assert hardware.driver_version == "580.95.05" and hardware.cuda_driver_version == "13.0"
    assert gpu.temperature_c == 55.0 and gpu.power_w == 120.0 and gpu.power_limit_w == 300.0
    json.dumps(hardware.to_dict())  # serialisable for `detect --json`


@pytest.mark.parametrize(("name", "cc", "vram", "sms", "integrated", "cls", "dtype", "attention"), CARDS, ids=IDS)
def test_profile_per_card(name, cc, vram, sms, integrated, cls, dtype, attention) -> None:  # type: ignore[no-untyped-def]
    hardware = detect_one(name, cc, vram, sms, integrated)
    shape = load_shape("qwen3-0.6b")
    profile = build_profile(hardware, shape)
    assert profile.device == "cuda" and profile.gpu_class == cls
    assert profile.dtype.value == dtype and profile.attention_backend.value == attention
    assert profile.metadata_cache.value is True
    plan = profile.memory_plan
    assert plan is not None and plan.fits, plan
    assert plan.estimate.peak * (1 + SAFETY_MARGIN) <= plan.budget_bytes
    assert profile.qlora is not None and profile.tokens_per_batch is not None
    if vram >= 8:
        assert profile.qlora.value is False  # a 0.6B model fits in 16-bit from 8 GiB up
    if integrated:
        assert profile.checkpointing.value != "offloaded"
        assert any("shares memory between CPU and GPU" in note for note in profile.notes)
    for choice in profile.choices().values():
        assert choice.reason and "\n" not in choice.reason
    fp8 = [note for note in profile.notes if "--fp8-base" in note]
    assert bool(fp8) is (cc >= (8, 9))  # fp8 tensor cores: RTX 40/50, Hopper, Blackwell, GB10; not RTX 30 or older
    # cuDNN's whole-row attention: automatic on Hopper only, where it was measured
    assert ("cuDNN" in profile.attention_backend.reason) is (cc[0] == 9)


@pytest.mark.parametrize(
    ("name", "routing"),
    [("NVIDIA H200", "sync-free"), ("NVIDIA B200", "sync-free"), ("NVIDIA GeForce RTX 4090", "sync-free"),
     ("NVIDIA GB10", "sync-free"), ("NVIDIA GeForce RTX 5090", "sync-free")],
)  # fmt: skip
def test_moe_routing_follows_grouped_mm_fast_path(name: str, routing: str) -> None:
    card = next(card for card in CARDS if card[0] == name)
    profile = build_profile(detect_one(*card[:5]), load_shape("qwen3-30b-a3b"))
    assert profile.moe_routing.value == routing
    one_kernel = "one kernel" in profile.moe_routing.reason
    assert one_kernel == (name in ("NVIDIA H200", "NVIDIA B200")), profile.moe_routing.reason


def test_no_gpu_reports_cpu_path() -> None:
    hardware = detect_hardware(nvml=FakeNvml([], missing_library=True), torch=fake_torch([], cuda_build=None))
    assert hardware.gpus == () and hardware.primary is None and hardware.gpu_class == gpus.CPU
    assert any("no NVIDIA driver" in note for note in hardware.notes)
    profile = build_profile(hardware, load_shape("qwen3-0.6b"))
    assert profile.device == "cpu" and profile.dtype.value == "float32" and profile.qlora.value is False  # type: ignore[union-attr]


def test_nothing_installed_never_crashes() -> None:
    hardware = detect_hardware(nvml=None, torch=None)
    assert hardware.gpu_class == gpus.CPU and len(hardware.notes) >= 2


def test_cpu_only_torch_with_a_gpu_present() -> None:
    gpu = FakeGpu("NVIDIA GeForce RTX 4090", (8, 9), 24, 128)
    hardware = detect_hardware(nvml=FakeNvml([gpu]), torch=fake_torch([], cuda_build=None))
    assert len(hardware.gpus) == 1 and not hardware.gpus[0].usable_by_torch
    assert hardware.gpu_class == gpus.CPU
    assert any("CPU-only torch" in note for note in hardware.notes)


def test_large_model_on_small_card_chooses_qlora_and_says_why() -> None:
    target = DeviceTarget.from_spec(gpus.find_gpu("RTX 4080"))  # type: ignore[arg-type]
    profile = build_profile(target, load_shape("llama-3.1-8b"))
    assert profile.qlora is not None and profile.qlora.value is True
    assert "Llama-3.1-8B" in profile.qlora.reason and "GiB" in profile.qlora.reason


@pytest.mark.parametrize(("card", "table_on_host"), [("RTX 4060", True), ("RTX 3060", True), ("RTX 4090", False)])
def test_an_8b_qlora_plan_counts_the_switches_the_engine_turns_on_by_itself(card: str, table_on_host: bool) -> None:
    """The engine moves Llama-3.1-8B's 1 GiB input embedding table to host memory on 8 and 12 GiB cards and keeps
    one layer's 16-bit weights through each recompute; the plan counts both, so an 8 GiB card is told which rows
    train (the engine ran 4,096 tokens at a 7.22 GiB peak under an 8 GiB cap, benchmarks/history/qlora_train_h200.md)
    instead of that nothing fits."""
    target = DeviceTarget.from_spec(gpus.find_gpu(card))  # type: ignore[arg-type]
    shape = load_shape("llama-3.1-8b")

    def plan(**overrides: object) -> MemoryPlan:
        memory_plan = build_profile(target, shape, overrides={"qlora": True, **overrides}, lora_rank=32).memory_plan
        assert memory_plan is not None
        return memory_plan

    automatic = plan()
    assert automatic.fits and automatic.tokens is not None and automatic.tokens >= 2048
    same_row = {"tokens_per_batch": automatic.tokens}
    table = shape.vocab_size * shape.hidden_size * 2
    on_gpu = plan(host_embedding=False, **same_row).estimate.peak - automatic.estimate.peak
    assert on_gpu == (table if table_on_host else 0)
    assert card != "RTX 4060" or not plan(host_embedding=False).fits
    assert plan(dequant_once=False, **same_row).estimate.peak < automatic.estimate.peak  # one layer's 16-bit weights


def test_a_plan_says_when_shorter_rows_would_train_markedly_faster() -> None:
    """On a 24 GiB card the largest 8B QLoRA batch (16,384 tokens, unchunked as the engine runs it there) keeps 5
    layers resident; rows of 4,096 tokens keep most of them (measured on the H200 under 24 GiB: 13,489 against 9,196
    tokens/s with 4 resident, benchmarks/history/qlora_train_h200.md; the FLOP estimate says 1.3x). The plan keeps
    its choice and says how to get the shorter rows with the same tokens per optimizer step; where the estimate gains
    less, or the user set the rows, it says nothing."""
    shape = load_shape("llama-3.1-8b")

    def notes(card: str, **overrides: object) -> list[str]:
        target = DeviceTarget.from_spec(gpus.find_gpu(card))  # type: ignore[arg-type]
        profile = build_profile(target, shape, overrides={"qlora": True, **overrides}, lora_rank=32)
        return [note for note in profile.notes if note.startswith("rows of")]

    (note,) = notes("RTX 4090")
    assert note.startswith("rows of 4,096 tokens would train about 1.3x faster here (offloaded checkpointing, 2")
    assert note.endswith(
        "with gradient accumulation 4 (--tokens-per-batch 4096 --grad-accum 4) each optimizer step still sees 16,384 "
        "tokens"
    )
    assert notes("RTX 4090", tokens_per_batch=16384) == [] and notes("H200") == [] and notes("RTX 4060") == []


def test_user_overrides_are_kept() -> None:
    target = DeviceTarget.from_spec(gpus.find_gpu("RTX 3090"))  # type: ignore[arg-type]
    overrides = {"checkpointing": "standard", "qlora": True, "dtype": "float16"}
    profile = build_profile(target, load_shape("llama-3.2-1b"), overrides=overrides)
    assert profile.checkpointing.value == "standard" and "set by you" in profile.checkpointing.reason
    assert profile.qlora.value is True and profile.dtype.value == "float16"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "cc", "integrated", "expected"),
    [("NVIDIA RTX A6000", (8, 6), False, gpus.RTX_WORKSTATION), ("NVIDIA RTX 6000 Ada Generation", (8, 9), False,
      gpus.RTX_WORKSTATION), ("NVIDIA A10", (8, 6), False, gpus.AMPERE_DATACENTER), ("NVIDIA L4", (8, 9), False,
      gpus.OTHER_NVIDIA), ("NVIDIA H100 80GB HBM3", (9, 0), False, gpus.HOPPER), ("Tesla V100-SXM2-16GB", (7, 0),
      False, gpus.OTHER_NVIDIA), ("NVIDIA B300", (10, 3), False, gpus.BLACKWELL_DATACENTER)],
)  # fmt: skip
def test_classify_more_cards(name: str, cc: tuple[int, int], integrated: bool, expected: str) -> None:
    assert classify(name, cc, integrated) == expected


@pytest.mark.gpu
def test_real_gpu_detection() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hardware = detect_hardware()
    gpu = hardware.primary
    assert gpu is not None and gpu.compute_capability == torch.cuda.get_device_capability(0)
    assert gpu.total_memory_bytes and gpu.sm_count and hardware.driver_version
    assert hardware.gpu_class != gpus.CPU
    profile = build_profile(hardware, load_shape("llama-3.2-1b"))
    assert profile.memory_plan is not None and profile.memory_plan.fits
