"""The settings TuneDeck picks for a device (and model), each with a one-line reason a user can read.

A profile turns detection into choices the engine's config accepts: dtype, attention backend, metadata cache,
checkpointing, MoE routing, LoRA vs QLoRA and tokens per batch. Memory choices come from the planner, so the
profile says "QLoRA: Llama-3.1-8B in 16-bit needs ~15 GiB ..." instead of guessing. Anything the user set
explicitly wins (``overrides``); checkpointing is decided by engine.hardware.checkpoint_choice, as in a run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.hardware import checkpoint_choice, gpus
from engine.hardware.detect import HardwareInfo
from engine.hardware.moe_choice import auto_moe_routing
from engine.hardware.planner import (
    CHUNK_MIN_ROW_TOKENS,
    GIB,
    MemoryPlan,
    TrainSetup,
    choose_memory_settings,
    chunk_tokens_for,
    host_embedding_automatic,
    training_flops_per_token,
    usable_bytes,
)
from engine.hardware.row_lengths import choose_row_lengths, round_up
from engine.hardware.shapes import ModelShape

PLANNER_STEP = 256
"""The planner sizes rows in steps of this many tokens (a CPU row is planned at the next step up)."""
MFU_LORA = 0.24
"""Share of peak tensor throughput a LoRA step reaches (measured on the H200: Llama-3.2-1B, 37k tokens/s)."""
MFU_QLORA = 0.45
"""QLoRA's share (measured on the H200, Llama-3.1-8B at 4,096 tokens with every switch automatic: 0.52 under an 8 GiB
cap, 11,134 tokens/s, and 0.47 under 24 GiB with resident layers, 12,624 tokens/s;
benchmarks/history/qlora_8gib_h200.md, benchmarks/qlora_resident_h200.md). Consumer cards reach a smaller share of
their rated throughput; not measured."""


@dataclass(frozen=True)
class Choice:
    value: Any
    reason: str


@dataclass(frozen=True)
class Profile:
    """What to run with on one device; memory choices are present when a model was given."""

    device: str
    gpu_class: str
    gpu_name: str | None
    dtype: Choice
    attention_backend: Choice
    metadata_cache: Choice
    checkpointing: Choice
    moe_routing: Choice
    qlora: Choice | None = None
    max_seq_len: Choice | None = None
    """The row length, where the device sets it (on a CPU it follows the model and the data)."""
    tokens_per_batch: Choice | None = None
    tokens_per_second: float | None = None
    memory_plan: MemoryPlan | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def choices(self) -> dict[str, Choice]:
        names = ("dtype", "attention_backend", "metadata_cache", "checkpointing", "moe_routing", "qlora")
        found = {name: getattr(self, name) for name in (*names, "max_seq_len", "tokens_per_batch")}
        return {name: choice for name, choice in found.items() if choice is not None}

    def to_dict(self) -> dict[str, Any]:
        plan = self.memory_plan
        return {
            "device": self.device,
            "gpu_class": self.gpu_class,
            "gpu_name": self.gpu_name,
            "choices": {name: {"value": c.value, "reason": c.reason} for name, c in self.choices().items()},
            "tokens_per_second": self.tokens_per_second,
            "predicted_peak_gib": round(plan.estimate.gib(), 2) if plan else None,
            "usable_gib": round(plan.budget_bytes / GIB, 2) if plan else None,
            "fits": plan.fits if plan else None,
            "longest_row_tokens": plan.longest_tokens if plan else None,
            "resident_layers": plan.resident_layers if plan else None,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class DeviceTarget:
    """The device a profile is for: detected, or taken from the GPU table for planning."""

    name: str | None
    gpu_class: str
    compute_capability: tuple[int, int] | None
    memory_bytes: int | None
    integrated: bool = False
    other_used_bytes: int = 0
    tflops: float | None = None
    wsl: bool = False
    cpu_cores: int = 1
    """The CPU's cores (what a CPU run trains with)."""
    assumed: bool = False
    """A card known by its memory alone (``tunedeck plan --vram``), planned as an RTX 40-series card: what only its
    architecture would tell (fp8 tensor cores) is not claimed."""

    @classmethod
    def from_hardware(cls, hardware: HardwareInfo) -> DeviceTarget:
        gpu = hardware.primary
        if gpu is None:
            return cls(None, gpus.CPU, None, hardware.host_memory_bytes, wsl=hardware.wsl, cpu_cores=hardware.cpu_count)
        spec = gpus.find_gpu(gpu.name)
        return cls(
            name=gpu.name,
            gpu_class=gpu.gpu_class,
            compute_capability=gpu.compute_capability,
            memory_bytes=gpu.total_memory_bytes,
            integrated=gpu.integrated,
            other_used_bytes=gpu.used_memory_bytes or 0,
            tflops=spec.tflops if spec else None,
            wsl=hardware.wsl,
        )

    @classmethod
    def from_spec(cls, spec: gpus.GpuSpec, vram_gib: float | None = None) -> DeviceTarget:
        memory = vram_gib if vram_gib is not None else spec.vram_gib
        return cls(spec.name, spec.gpu_class, spec.compute_capability, int(memory * GIB), spec.unified_memory,
                   tflops=spec.tflops)  # fmt: skip

    @property
    def is_gpu(self) -> bool:
        return self.compute_capability is not None

    @property
    def label(self) -> str:
        return self.name or "CPU"


@functools.cache
def _torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is at least ``major.minor`` (read once: the gallery plans a thousand rows)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = [int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit()]
    return tuple(parts) >= (major, minor)


def choose_dtype(target: DeviceTarget) -> Choice:
    if not target.is_gpu:
        return Choice("float32", "CPU: fp32 (16-bit matmuls are slow or unsupported on most CPUs)")
    if (target.compute_capability or (0, 0)) >= (8, 0):
        return Choice("bfloat16", f"bf16: {target.label} supports it (sm_{_sm(target)}), no loss scaling needed")
    return Choice("float16", f"fp16: {target.label} (sm_{_sm(target)}) has no bf16; gradients use loss scaling")


def _sm(target: DeviceTarget) -> str:
    major, minor = target.compute_capability or (0, 0)
    return f"{major}{minor}"


def choose_attention(target: DeviceTarget, dtype: str) -> Choice:
    cc = target.compute_capability
    if cc is None:
        return Choice("sdpa", "CPU: PyTorch SDPA with the packed mask (the GPU kernels need CUDA)")
    if cc >= (8, 0) and dtype in ("bfloat16", "float16") and _torch_at_least(2, 10):
        why = f"varlen: torch's FlashAttention-2 kernel for packed rows runs on sm_{_sm(target)}"
        if cc[0] in gpus.CUDNN_ATTENTION_MAJORS:
            why += "; a row holding one document runs through cuDNN's faster fused kernel"
        return Choice("varlen", why)
    if cc >= (8, 0) and importlib.util.find_spec("flash_attn") is not None:
        return Choice("flash_attn", "flash_attn: the flash-attn package is installed and this torch lacks varlen_attn")
    if cc < (8, 0):
        return Choice("sdpa", f"sdpa: FlashAttention-2 needs sm_80+, {target.label} is sm_{_sm(target)}")
    return Choice("sdpa", "sdpa: this torch has no varlen_attn (torch >= 2.10) and flash-attn is not installed")


def choose_metadata_cache(target: DeviceTarget) -> Choice:
    if not target.is_gpu:
        return Choice(True, "metadata cache on: the packed rows' block mask is built once per batch (SDPA on the CPU)")
    return Choice(True, "metadata cache on: document boundaries built once per batch, not in every layer "
                        "(~200-320 ms/step saved on 1B-class models)")  # fmt: skip


def choose_moe_routing(target: DeviceTarget, dtype: str, shape: ModelShape | None) -> Choice:
    if shape is not None and not shape.is_moe:
        return Choice("stock", f"MoE routing: {shape.display_name()} has no expert layers")
    mode, reason = auto_moe_routing(True, target.is_gpu, target.compute_capability, dtype)
    return Choice(mode, f"MoE routing {mode}: {reason}")


def _default_checkpointing(target: DeviceTarget) -> Choice:
    """Checkpointing for a device without a model to plan for (engine.hardware.checkpoint_choice decides)."""
    plan = checkpoint_choice.decide_checkpointing(checkpoint_choice.CheckpointFacts(on_gpu=target.is_gpu))
    word = "off" if plan.mode == "none" else plan.mode
    return Choice(plan.mode, f"checkpointing {word}: {plan.reason.removeprefix('CPU: ')}")


def can_offload(target: DeviceTarget) -> tuple[bool, str | None]:
    if target.integrated:
        return False, f"offloaded checkpointing off: {target.label} shares memory between CPU and GPU"
    if target.wsl:
        return False, "offloaded checkpointing off: WSL caps pinned host memory"
    return True, None


def build_profile(
    target: DeviceTarget | HardwareInfo,
    shape: ModelShape | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    lora_rank: int = 16,
    min_tokens: int = 0,
    max_tokens: int = 16384,
) -> Profile:
    """Choose every setting for ``target``; ``overrides`` (config field name -> value) are kept as given.
    ``min_tokens``: the row length (``data.max_seq_len``; 0: automatic, 2,048 on a GPU)."""
    if isinstance(target, HardwareInfo):
        target = DeviceTarget.from_hardware(target)
    overrides = dict(overrides or {})
    rows = choose_row_lengths(
        on_gpu=target.is_gpu,
        max_seq_len=min_tokens,
        tokens_per_batch=overrides.get("tokens_per_batch") or 0,
        shape=shape,
        cpu_cores=target.cpu_cores,
        qlora=bool(overrides.get("qlora")),
    )
    min_tokens = rows.max_seq_len
    if not target.is_gpu:  # the CPU's row is its speed budget, not the largest that fits in host memory
        overrides["tokens_per_batch"] = round_up(rows.tokens_per_batch, PLANNER_STEP)
    dtype = _override(overrides, "dtype") or choose_dtype(target)
    attention = _override(overrides, "attention_backend") or choose_attention(target, dtype.value)
    choices: dict[str, Any] = {  # Choices, as keyword arguments of Profile
        "dtype": dtype,
        "attention_backend": attention,
        "metadata_cache": _override(overrides, "metadata_cache") or choose_metadata_cache(target),
        "moe_routing": _override(overrides, "moe_routing") or choose_moe_routing(target, dtype.value, shape),
        "checkpointing": _override(overrides, "checkpointing") or _default_checkpointing(target),
    }
    notes: list[str] = [note for note in (fp8_note(target),) if note]
    if shape is None or target.memory_bytes is None:
        return Profile("cuda" if target.is_gpu else "cpu", target.gpu_class, target.name, notes=tuple(notes), **choices)
    plan = _memory_plan(target, shape, choices, overrides, lora_rank, min_tokens, max_tokens)
    _, offload_note = can_offload(target)
    if offload_note and target.is_gpu:
        notes.append(offload_note)
    extra = _memory_choices(plan, overrides, target)
    if not target.is_gpu:
        extra["max_seq_len"] = Choice(rows.max_seq_len, rows.max_seq_len_reason)
        if plan.fits:
            extra["tokens_per_batch"] = Choice(rows.tokens_per_batch, rows.tokens_per_batch_reason)
    choices.update(extra)
    if not plan.fits:
        notes.append(plan.reasons.get("fit", "does not fit"))
    speed = tokens_per_second(target, shape, plan) if plan.fits else None
    if speed is not None and "tokens_per_batch" not in overrides:

        def rows_of(tokens: int) -> MemoryPlan:
            return _memory_plan(target, shape, choices, overrides, lora_rank, tokens, tokens)

        shorter = faster_rows_note(target, shape, plan, speed, rows_of, min_tokens)
        if shorter:
            notes.append(shorter)
    return Profile("cuda" if target.is_gpu else "cpu", target.gpu_class, target.name, **choices,
                   tokens_per_second=speed, memory_plan=plan, notes=tuple(notes))  # fmt: skip


FASTER_ROWS_GAIN = 1.15
"""Shorter rows are suggested when the speed estimate puts them at least this much faster than the plan's."""
SHORTEST_SUGGESTED_ROW = 4096
"""No shorter row is suggested: the speed estimate counts FLOPs, not the per-step costs that grow as rows shrink
(H200, Llama-3.1-8B QLoRA under 24 GiB: 4,096-token rows 1.51x faster than 16,384,
benchmarks/qlora_train_top_layer_h200.md)."""


def faster_rows_note(
    target: DeviceTarget,
    shape: ModelShape,
    plan: MemoryPlan,
    speed: float,
    plan_for: Callable[[int], MemoryPlan],
    min_tokens: int,
) -> str | None:
    """The largest batch that fits is the plan's choice; where shorter rows would train markedly faster (they leave
    memory for resident layers and need no MLP chunks), say how to get them with the same tokens per optimizer step.
    ``speed``: the plan's estimated tokens/s; ``plan_for(tokens)``: the plan with rows of exactly ``tokens`` tokens."""
    if plan.tokens is None:
        return None
    best: tuple[float, MemoryPlan] | None = None
    tokens = plan.tokens // 2
    while tokens >= max(min_tokens, SHORTEST_SUGGESTED_ROW):
        shorter = plan_for(tokens)
        rate = tokens_per_second(target, shape, shorter) if shorter.fits else None
        if rate is not None and (best is None or rate > best[0]):
            best = (rate, shorter)
        tokens //= 2
    if best is None or best[0] < FASTER_ROWS_GAIN * speed:
        return None
    rate, shorter = best
    if shorter.tokens is None:
        return None
    resident = f", {shorter.resident_layers} layers resident" if shorter.resident_layers else ""
    return (
        f"rows of {shorter.tokens:,} tokens would train about {rate / speed:.1f}x faster here ({shorter.checkpointing} "
        f"checkpointing{resident}); with gradient accumulation {plan.tokens // shorter.tokens} (--tokens-per-batch "
        f"{shorter.tokens} --grad-accum {plan.tokens // shorter.tokens}) each optimizer step still sees "
        f"{plan.tokens:,} tokens"
    )


def fp8_note(target: DeviceTarget) -> str | None:
    """A GPU with fp8 tensor cores (sm89+: RTX 40/50 series, Hopper, Blackwell, GB10) can run the frozen-weight
    products in fp8 (engine.speed.fp8_base): worth saying, as it is automatic only for QLoRA's recompute."""
    if not target.is_gpu or target.assumed or target.compute_capability is None or target.compute_capability < (8, 9):
        return None
    return (
        f"{target.label} has fp8 tensor cores: --fp8-base all runs the frozen base weights' products in fp8, "
        "faster where the GPU sets the pace, at fp8 rounding (automatic in a QLoRA run's recompute and input "
        "gradients, --fp8-base recompute, the forward pass kept 16-bit)"
    )


def _override(overrides: Mapping[str, Any], name: str) -> Choice | None:
    if name in overrides and overrides[name] not in (None, "auto"):
        return Choice(overrides[name], f"{name} = {overrides[name]}: set by you")
    return None


def _memory_plan(
    target: DeviceTarget,
    shape: ModelShape,
    choices: dict[str, Choice],
    overrides: Mapping[str, Any],
    lora_rank: int,
    min_tokens: int,
    max_tokens: int,
) -> MemoryPlan:
    memory = target.memory_bytes or 0
    if target.is_gpu:
        budget = usable_bytes(memory, integrated=target.integrated, other_used_bytes=target.other_used_bytes)
    else:
        budget = int(memory * 0.6)  # leave the operating system and the data pipeline their share
    dtype_bytes = 4 if choices["dtype"].value == "float32" else 2
    attention = choices["attention_backend"].value
    if attention == "cudnn":  # cuDNN serves rows of one document; packed rows take the automatic kernel
        attention = choose_attention(target, choices["dtype"].value).value
    chunked = overrides.get("chunked_mlp")
    base = TrainSetup(
        lora_rank=lora_rank,
        dtype_bytes=dtype_bytes,
        attention=attention,
        # the engine runs long rows' MLPs in chunks under checkpointing when memory is short (on a GPU); planned
        # for the compiled layers' scope, the MLP only, which keeps more than eager layers' chunked norms do
        chunk_tokens=chunk_tokens_for(shape.intermediate_size, shape.hidden_size)
        if target.is_gpu and chunked is not False
        else None,
        chunk_min_tokens=0 if chunked else CHUNK_MIN_ROW_TOKENS,
        chunk_scope="mlp",
        # switches the engine turns on by itself on a GPU, planned as it runs: the input embedding table in host
        # memory where it would crowd the card, and 4-bit weights dequantized once per recompute (counted where it
        # acts: QLoRA under offloaded checkpointing)
        host_embedding=target.is_gpu
        and overrides.get("host_embedding") is not False
        and host_embedding_automatic(shape, dtype_bytes, budget),
        dequant_once=target.is_gpu and overrides.get("dequant_once") is not False,
    )
    fixed_tokens = overrides.get("tokens_per_batch")
    checkpointing = overrides.get("checkpointing")
    return choose_memory_settings(
        shape,
        budget,
        base=base,
        compute_capability=target.compute_capability,
        can_offload=can_offload(target)[0] and target.is_gpu,
        qlora=overrides.get("qlora") if target.is_gpu else overrides.get("qlora", False),
        checkpointing=checkpointing if checkpointing not in (None, "auto") else None,
        min_tokens=fixed_tokens or min_tokens,
        preferred_tokens=fixed_tokens or max(min_tokens, 8192),
        max_tokens=fixed_tokens or max(max_tokens, min_tokens),
    )


def _memory_choices(plan: MemoryPlan, overrides: Mapping[str, Any], target: DeviceTarget) -> dict[str, Choice]:
    reasons = plan.reasons
    if not plan.fits:
        why = reasons.get("fit", "does not fit")
        return {
            "qlora": Choice(plan.qlora, why),
            "checkpointing": _override(overrides, "checkpointing") or Choice(plan.checkpointing, why),
        }
    out = {
        "qlora": _override(overrides, "qlora") or Choice(plan.qlora, reasons["qlora"]),
        "checkpointing": _override(overrides, "checkpointing") or Choice(plan.checkpointing, reasons["checkpointing"]),
        "tokens_per_batch": _override(overrides, "tokens_per_batch")
        or Choice(plan.tokens, reasons["tokens_per_batch"]),
    }
    if not target.is_gpu:
        out["qlora"] = _override(overrides, "qlora") or Choice(False, "LoRA: 4-bit quantization saves no time on CPU")
    return out


def tokens_per_second(target: DeviceTarget, shape: ModelShape, plan: MemoryPlan) -> float | None:
    """A rough training throughput: the card's tensor throughput at the utilisation measured on the H200."""
    if target.tflops is None or plan.tokens is None:
        return None
    setup = dataclasses.replace(
        TrainSetup(), tokens=plan.tokens, checkpointing=plan.checkpointing, resident_layers=plan.resident_layers
    )
    mfu = MFU_QLORA if plan.qlora else MFU_LORA
    return mfu * target.tflops * 1e12 / training_flops_per_token(shape, setup)
