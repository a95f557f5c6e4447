"""The speed plan of one run shape, decided by one pure function from typed facts.

:func:`decide_plan` turns :class:`SpeedFacts` (what the model, the device and the run so far are) and the user's
:class:`~engine.config.SpeedConfig` into a frozen :class:`~engine.speed.plan.SpeedPlan`: every setting resolved to
on or off (or a mode, a count, a scope) with a one-line reason. It touches no model, no GPU and no clock, so every
rule is a row in a table test (tests/test_speed_decide.py), with device properties faked for GPUs this machine does
not have. :class:`engine.speed.SpeedController` reads the facts (``SpeedController.facts``), decides, and installs
what differs from the plan in force; a live switch, a longer row and an out-of-memory step are each new facts (or
settings) and a new decision, never a step replayed in some order.

Some choices read others; each reads only choices made above it in :func:`decide_plan`, so the data says the order:

* cuDNN attention reads the metadata cache (one-document rows are found there);
* chunked MLPs, dequantize-once, fp8 products and resident layers read the checkpointing mode (they act only in a
  recompute, fp8 and dequantize-once only in offloaded checkpointing's);
* fp8 products and chunked MLPs read the fused kernels (compiled layers chunk only their MLPs, and cast 4-bit
  weights to e4m3 in one pass);
* resident layers read the chunked MLPs (a row that needs chunks has no spare memory) and the plan so far, which
  the planner sizes them with;
* step graphs read the fused kernels (a compiled step's warm-up trial) and the chunked MLPs (no room for a graph's
  memory pool).

Memory figures are read once per run shape (a new setting, a longer row), before the decision, so an
out-of-memory step that hands back resident layers decides with the same figures and turns nothing else off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import cast

import torch

from engine.config import SpeedConfig
from engine.hardware import checkpoint_choice
from engine.hardware.checkpoint_choice import Checkpointing, CheckpointPlan, Requested
from engine.hardware.shapes import ModelShape
from engine.speed import (
    chunked_mlp,
    fp8_base,
    fused_kernels,
    host_embedding,
    lean_recompute,
    lora_16bit,
    metadata_cache,
    moe_routing,
    resident_layers,
    step_graphs,
    warm_up,
)
from engine.speed.plan import (
    Choice,
    Fp8Choice,
    GraphsChoice,
    LoraChoice,
    MetadataChoice,
    ModeChoice,
    ResidentChoice,
    SpeedPlan,
)

ACTIVATION_BYTES_PER_TOKEN_AND_HIDDEN = 34
"""Bytes kept per token × hidden per layer without checkpointing in 16-bit (Korthikanti et al., flash attention)."""
NO_RECOMPUTE_FREE_SHARE = 0.6
"""Automatic checkpointing keeps every activation only for rows whose activations fit in this share of free memory."""


@dataclass(frozen=True)
class Fp8Coverage:
    """Which frozen projections fp8 products reach: those whose widths are multiples of 16, and of those the 4-bit
    weights the one-pass kernel casts to e4m3 (when the layers are compiled)."""

    total: int = 0
    fits: int = 0
    one_pass: int = 0


@dataclass(frozen=True)
class ModelFacts:
    """What the choices read from the model (its structure, dtype and adapters), with each switch's reason it cannot
    apply to it (None where it can)."""

    dtype: torch.dtype = torch.bfloat16
    shape: ModelShape | None = None
    """Sizes for the planner (resident layers) and the attention head width; None where the config gives none."""
    layers: int = 0
    """Decoder layers."""
    attention_problem: str | None = None
    fused_loss_problem: str | None = None
    fused_kernels_problem: str | None = None
    fused_kernels_automatic: tuple[bool, str] = (False, "automatic: off")
    """What automatic fused kernels are on this model and device before the run's length is counted."""
    lora_16bit_problem: str | None = None
    lora_groups: int = 0
    """Groups of projections that read the same input (one LoRA A product each on the 16-bit path)."""
    graphs_problem: str | None = None
    host_embedding_problem: str | None = None
    embedding_bytes: int = 0
    experts: bool = False
    """transformers 3-D expert layers the MoE routing can take."""
    frozen_projections: int = 0
    dequant_bytes: int = 0
    """One layer's 16-bit copies of its 4-bit projections read in recompute (dequantize-once's extra memory)."""
    fp8: Fp8Coverage = Fp8Coverage()
    qlora: bool = False
    lora_rank: int = 16
    activation_units: int = 0
    """hidden × layers of the text model: what a token keeps without checkpointing, in units of 34 bytes (0: the
    config gives no size)."""
    row_bytes_per_token: int = 0
    """What one layer's per-token modules hold per token of a row without chunks (chunked_mlp.row_working_bytes)."""
    stock_experts: str | None = None
    """The experts implementation transformers would run without TuneDeck (None: its default)."""


@dataclass(frozen=True)
class DeviceFacts:
    """The device the run trains on, and the GPU memory it may use (read once per run shape)."""

    kind: str = "cpu"
    capability: tuple[int, int] | None = None
    has_cudnn: bool = False
    offload_blocker: str | None = None
    attention_kernels: tuple[tuple[str, str | None], ...] = ()
    """Each packed-attention backend with its reason it cannot run here (None: it can)."""
    fp8_problem: str | None = "fp8 products need an NVIDIA GPU with fp8 tensor cores"
    grouped_mm_fast: bool = False
    free_bytes: int | None = None
    """Free GPU memory under any allocator cap (None on a CPU)."""
    usable_bytes: int | None = None
    """All the GPU memory this process may use (the card's, or the cap's)."""
    reachable_bytes: int | None = None
    """What this process holds and what is free, within the cap: the resident layers' budget."""

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"


@dataclass(frozen=True)
class RunFacts:
    """The run so far: its longest row, what it refused after a failure, and its warm-up ledger."""

    longest_tokens: int = 0
    checkpoint_tokens: int = 0
    """The rows automatic checkpointing was last decided for (it is decided again only when rows grow)."""
    graphs_refused: str | None = None
    """Why this run cannot replay micro-batches (several GPUs, float16 loss scaling); None where it can."""
    fused_loss_refused: str | None = None
    """Why this run's loss is not the causal-LM cross-entropy (DPO); None where it is."""
    resident_refused: str | None = None
    """Why resident layers were handed back (an out-of-memory step) until memory has room."""
    resident_override: int | None = None
    """A fixed number of resident layers (tests, benches); None: what the planner fits."""
    warm_up: warm_up.WarmUpLedger = field(default_factory=warm_up.WarmUpLedger, compare=False)
    """The run's length and earlier runs' measurements (read here, never changed)."""


@dataclass(frozen=True)
class SpeedFacts:
    model: ModelFacts = ModelFacts()
    device: DeviceFacts = DeviceFacts()
    run: RunFacts = RunFacts()


def decide_plan(facts: SpeedFacts, settings: SpeedConfig) -> SpeedPlan:
    """Every speed setting's choice for this model, device and run so far; each choice reads only those above it."""
    model, device, run = facts.model, facts.device, facts.run
    metadata = _metadata_cache(model, device, settings)
    checkpointing = _checkpointing(model, device, run, settings.checkpointing)
    mode = checkpointing.mode
    chunked = Choice(*_chunked_mlp(model, device, run, settings, mode))
    compiled, compiled_reason = _fused_kernels(model, run, settings, memory_tight=chunked.on)
    plan = SpeedPlan(
        metadata_cache=metadata,
        cudnn_attention=Choice(*_cudnn_attention(model, device, metadata, settings)),
        moe_routing=_moe_routing(model, device, settings),
        fused_loss=Choice(*_fused_loss(model, run, settings)),
        checkpointing=checkpointing,
        chunked_mlp=chunked,
        host_embedding=Choice(*_host_embedding(model, device, settings)),
        lora_16bit=_lora_16bit(model, settings),
        dequant_once=Choice(*_dequant_once(model, device, settings, mode)),
        fp8_base=_fp8_base(model, device, settings, mode, compiled),
        fused_kernels=Choice(compiled, compiled_reason),
    )
    plan = dataclasses.replace(plan, resident_layers=_resident_layers(facts, settings, plan))
    return dataclasses.replace(plan, step_graphs=_step_graphs(model, run, settings, compiled, chunked.on))


TIGHT_MEMORY_COMPILED = (
    "; on however short the run: its rows need the MLPs in chunks to fit, and eager kernels keep more memory "
    "(H200, Llama-3.1-8B in 4-bit, 16,384 tokens under 8 GiB: out of memory eager, 7,022 tokens/s compiled)"
)


def _fused_kernels(model: ModelFacts, run: RunFacts, settings: SpeedConfig, memory_tight: bool) -> tuple[bool, str]:
    """Compiled kernels where they apply, unless the run is too short to earn the compile back; a run whose rows
    only fit with the MLPs in chunks (``memory_tight``) keeps them whatever its length, for the memory they save."""
    on, reason = fused_kernels.resolve_from(
        settings.fused_kernels, model.fused_kernels_problem, model.fused_kernels_automatic
    )
    if on and memory_tight and settings.fused_kernels is None:
        return True, reason + TIGHT_MEMORY_COMPILED
    return run.warm_up.fused_kernels(settings.fused_kernels, on, reason)


def _metadata_cache(model: ModelFacts, device: DeviceFacts, settings: SpeedConfig) -> MetadataChoice:
    where = f"{device.kind} {str(model.dtype).removeprefix('torch.')}"
    choice = metadata_cache.choose_backend_from(settings.attention_backend, dict(device.attention_kernels), where)
    if settings.metadata_cache is False:
        return MetadataChoice(False, None, "switched off: transformers' own packed path")
    if model.attention_problem is not None:
        return MetadataChoice(False, None, model.attention_problem)
    reason = choice.reason if settings.metadata_cache is None else f"switched on; {choice.reason}"
    return MetadataChoice(True, choice.name, reason)


def _cudnn_attention(
    model: ModelFacts, device: DeviceFacts, metadata: MetadataChoice, settings: SpeedConfig
) -> tuple[bool, str]:
    if metadata.backend is None:
        problem: str | None = "needs the metadata cache (one-document rows are found there)"
    else:
        head_dim = model.shape.head_dim if model.shape is not None else 0
        problem = metadata_cache.cudnn_problem(device.kind, model.dtype, device.capability, head_dim, device.has_cudnn)
    return metadata_cache.resolve_cudnn(settings.attention_backend, problem, device.capability)


def _moe_routing(model: ModelFacts, device: DeviceFacts, settings: SpeedConfig) -> ModeChoice:
    dtype = str(model.dtype).removeprefix("torch.")
    requested = settings.moe_routing
    mode, reason = moe_routing.resolve_mode(
        requested, model.experts, device.kind, device.capability, dtype, device.grouped_mm_fast
    )
    if mode == "stock" and requested == "stock":
        reason = f"switched off: transformers' {model.stock_experts or 'default'} experts implementation"
    return ModeChoice(mode, reason)


def _fused_loss(model: ModelFacts, run: RunFacts, settings: SpeedConfig) -> tuple[bool, str]:
    if run.fused_loss_refused is not None:
        return False, f"off: {run.fused_loss_refused}"
    if settings.fused_loss is False:
        return False, "switched off: the model's own head and transformers' loss"
    if model.fused_loss_problem is not None:
        return False, model.fused_loss_problem
    how = "loss and gradient from the hidden states in chunks, no full logits"
    # no host sync: the packer lists the trained positions (PackedBatch.loss_positions)
    return True, f"automatic: {how}" if settings.fused_loss is None else f"switched on; {how}"


def _checkpointing(model: ModelFacts, device: DeviceFacts, run: RunFacts, requested: str) -> CheckpointPlan:
    return checkpoint_choice.decide_checkpointing(
        checkpoint_facts(model, device, run, requested), cast(Requested, requested)
    )


def checkpoint_facts(
    model: ModelFacts, device: DeviceFacts, run: RunFacts, requested: str
) -> checkpoint_choice.CheckpointFacts:
    """What the checkpointing decision needs; the rows that fit are counted only when it is automatic on a GPU."""
    if requested != "auto" or not device.on_gpu:
        return checkpoint_choice.CheckpointFacts(device.on_gpu, device.offload_blocker)
    modes = checkpoint_choice.candidate_modes(can_offload=device.offload_blocker is None)
    fits = tuple((mode, _tokens_without_recompute(model, device) if mode == "none" else None) for mode in modes)
    return checkpoint_choice.CheckpointFacts(True, device.offload_blocker, fits, wanted_tokens=run.checkpoint_tokens)


def _tokens_without_recompute(model: ModelFacts, device: DeviceFacts) -> int | None:
    """The longest row whose activations fit in 60% of the free GPU memory without checkpointing (None: the
    model's config gives no size to count)."""
    if not model.activation_units or device.free_bytes is None:
        return None
    per_token = model.activation_units * ACTIVATION_BYTES_PER_TOKEN_AND_HIDDEN
    return int(NO_RECOMPUTE_FREE_SHARE * device.free_bytes // per_token)


def _chunked_mlp(
    model: ModelFacts, device: DeviceFacts, run: RunFacts, settings: SpeedConfig, mode: Checkpointing
) -> tuple[bool, str]:
    tokens = run.longest_tokens
    working = tokens * model.row_bytes_per_token
    free = device.free_bytes if device.on_gpu else None
    return chunked_mlp.resolve(settings.chunked_mlp, mode, tokens, working_bytes=working, free_bytes=free)


def _host_embedding(model: ModelFacts, device: DeviceFacts, settings: SpeedConfig) -> tuple[bool, str]:
    usable = device.usable_bytes if device.on_gpu else None
    return host_embedding.resolve(
        settings.host_embedding, device.on_gpu, model.host_embedding_problem, model.embedding_bytes, usable
    )


def _lora_16bit(model: ModelFacts, settings: SpeedConfig) -> LoraChoice:
    on, reason = lora_16bit.resolve_from(settings.lora_16bit, model.lora_16bit_problem)
    groups = model.lora_groups if on else 0
    if groups:  # the 16-bit path shares one LoRA A product per group of projections reading the same input
        reason += f"; one A product for each of {groups} groups of projections reading the same input"
    return LoraChoice(on, reason, groups)


def _dequant_once(
    model: ModelFacts, device: DeviceFacts, settings: SpeedConfig, mode: Checkpointing
) -> tuple[bool, str]:
    free = device.free_bytes if device.on_gpu else None
    return lean_recompute.dequant_once_resolve(settings.dequant_once, mode, model.dequant_bytes, free)


def _fp8_base(
    model: ModelFacts, device: DeviceFacts, settings: SpeedConfig, mode: Checkpointing, compiled: bool
) -> Fp8Choice:
    requested, four_bit = settings.fp8_base, model.dequant_bytes > 0
    on, reason = fp8_base.resolve_from(
        requested, device.fp8_problem, model.frozen_projections, mode, four_bit, model.experts
    )
    scope = fp8_base.scope_of(requested)
    on, reason = fp8_base.scoped(on, reason, scope, mode)
    if on:
        coverage = model.fp8
        reason += fp8_coverage(coverage.fits, coverage.one_pass if compiled else 0, coverage.total)
    return Fp8Choice(on, scope if on else None, reason)


def fp8_coverage(done: int, one_pass: int, total: int) -> str:
    """What the fp8-base reason adds: projections left in 16 bits, and the 4-bit weights cast in one pass."""
    words = ""
    if done < total:
        words += f" ({done} of {total} frozen projections; the others' widths are not multiples of 16)"
    if one_pass:
        words += f"; {one_pass} 4-bit weights go to e4m3 in one pass (fused kernels)"
    return words


def _resident_layers(facts: SpeedFacts, settings: SpeedConfig, plan: SpeedPlan) -> ResidentChoice:
    model, device, run = facts.model, facts.device, facts.run
    mode = plan.checkpointing.mode if plan.checkpointing is not None else "none"
    requested, total = settings.resident_layers, model.layers
    blocker = _resident_blocker(device, run, plan)
    count, budget = 0, None
    if requested is not False and mode != "none" and blocker is None:
        count, budget = _resident_count(model, device, run, plan)
    layers, reason = resident_layers.resolve(
        requested, mode, layers=min(count, total), total=total, blocker=blocker, budget_bytes=budget
    )
    return ResidentChoice(layers, reason)


def _resident_blocker(device: DeviceFacts, run: RunFacts, plan: SpeedPlan) -> str | None:
    if run.resident_refused is not None:
        return run.resident_refused
    if plan.is_on("chunked_mlp"):
        return "the row needs its MLPs in chunks: no spare memory"
    if run.resident_override is None and device.reachable_bytes is None:
        return "the count is sized from a GPU's free memory"
    if run.resident_override is None and not run.longest_tokens:
        return "sized when the first batch arrives"
    return None


def _resident_count(model: ModelFacts, device: DeviceFacts, run: RunFacts, plan: SpeedPlan) -> tuple[int, int | None]:
    """(layers, the memory they were sized for: None for a fixed count)."""
    if run.resident_override is not None:
        return run.resident_override, None
    budget = cast(int, device.reachable_bytes)
    if model.shape is None:
        return 0, budget
    count = resident_layers.planned_layers_for(
        model.shape, model.qlora, model.lora_rank, plan.as_state(), run.longest_tokens, budget, device.capability
    )
    return count, budget


def _step_graphs(
    model: ModelFacts, run: RunFacts, settings: SpeedConfig, compiled: bool, chunked: bool
) -> GraphsChoice:
    requested = settings.step_graphs
    on, reason = step_graphs.resolve(requested, model.graphs_problem)
    on, reason, trial = run.warm_up.step_graphs(requested, on, reason, compiled=compiled)
    if run.graphs_refused is not None and (on or requested):
        return GraphsChoice(False, f"off: {run.graphs_refused}", False)
    if on and requested is None and chunked:  # the row needs chunks to fit: no room for a graph's memory pool
        return GraphsChoice(False, step_graphs.MEMORY_BOUND, False)
    return GraphsChoice(on, reason, on and trial)
