"""DDP or FSDP2 on several GPUs: which one a run should use, and why, from the model's shape and the cards.

DDP keeps a whole copy of the base model on every card and only averages the (small) LoRA gradients once per
step, so it scales almost linearly; it is the choice whenever the model fits one card. FSDP2 shards the frozen
base weights across the cards and gathers one decoder layer at a time, so a model that is too big for one card
still trains, at the price of moving every layer's weights over the interconnect in forward, recompute and
backward. 4-bit (QLoRA) weights are not sharded: a QLoRA model that does not fit one card does not fit at all.

The memory figures come from :mod:`engine.hardware.planner`; FSDP2's peak is the planner's single-card peak with
the weights divided by the number of cards plus the layers FSDP2 holds gathered at once (the one computing and
the one prefetched).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from engine.hardware import checkpoint_choice
from engine.hardware.fit_to_data import MEMORY_RANK
from engine.hardware.planner import (
    GIB,
    SAFETY_MARGIN,
    TrainSetup,
    estimate_memory,
    weight_bytes,
)
from engine.hardware.row_lengths import GPU_TOKENS_PER_BATCH
from engine.hardware.shapes import ModelShape, load_shape

if TYPE_CHECKING:
    from engine.config import RunConfig

ParallelMode = Literal["single", "ddp", "fsdp"]
GATHERED_LAYERS = 2
"""Decoder layers FSDP2 holds unsharded at once: the one computing and the next one, prefetched."""


@dataclass(frozen=True)
class ParallelPlan:
    """How a run spreads over ``gpus`` cards, with a reason a user can read."""

    mode: ParallelMode
    gpus: int
    reason: str
    peak_bytes_per_gpu: int | None
    """Predicted allocator peak on each card (None when the shape is unknown)."""
    fits: bool = True


def fsdp_peak(shape: ModelShape, setup: TrainSetup, gpus: int, compute_capability: tuple[int, int] | None) -> int:
    """Predicted per-card peak of an FSDP2 step: sharded weights and adapter, gathered layers, full activations."""
    single = estimate_memory(shape, setup, compute_capability)
    layer_weights = (weight_bytes(shape, setup) - _non_layer_weights(shape, setup)) // max(shape.num_layers, 1)
    sharded = replace(single, weights=single.weights // gpus, adapter=single.adapter // gpus)
    return sharded.peak + GATHERED_LAYERS * layer_weights


def _non_layer_weights(shape: ModelShape, setup: TrainSetup) -> int:
    return shape.embedding_params() * setup.dtype_bytes


def _fits(peak: int, budget_bytes: int) -> bool:
    return peak * (1 + SAFETY_MARGIN) <= budget_bytes


def choose_parallel(
    shape: ModelShape | None,
    setup: TrainSetup,
    gpus: int,
    budget_bytes: int,
    *,
    requested: Literal["auto", "ddp", "fsdp"] = "auto",
    compute_capability: tuple[int, int] | None = (9, 0),
) -> ParallelPlan:
    """DDP vs FSDP2 for ``gpus`` cards with ``budget_bytes`` usable each (``shape`` None: unknown model)."""
    if gpus <= 1:
        return ParallelPlan("single", 1, "one GPU: no distributed training", None)
    if requested == "fsdp" and setup.qlora:
        return ParallelPlan("ddp", gpus, "FSDP2 requested, but 4-bit QLoRA weights cannot be sharded: DDP", None)
    if shape is None:
        mode: ParallelMode = "fsdp" if requested == "fsdp" else "ddp"
        why = "requested" if requested != "auto" else "auto: the model's size is unknown, DDP is the fast default"
        return ParallelPlan(mode, gpus, f"{mode.upper()} {why}", None)
    single = estimate_memory(shape, setup, compute_capability).peak
    sharded = fsdp_peak(shape, setup, gpus, compute_capability)
    if requested == "ddp":
        return ParallelPlan("ddp", gpus, "DDP requested", single, _fits(single, budget_bytes))
    if requested == "fsdp":
        return ParallelPlan("fsdp", gpus, "FSDP2 requested", sharded, _fits(sharded, budget_bytes))
    return _auto(shape, setup, gpus, budget_bytes, single, sharded)


def _auto(
    shape: ModelShape, setup: TrainSetup, gpus: int, budget_bytes: int, single: int, sharded: int
) -> ParallelPlan:
    usable, name = budget_bytes / GIB, shape.display_name()
    if _fits(single, budget_bytes):
        why = (
            f"DDP: {name} fits one card (~{single / GIB:.1f} GiB of {usable:.1f} GiB usable), so each GPU keeps a "
            "full copy and only the LoRA gradients cross between cards"
        )
        return ParallelPlan("ddp", gpus, why, single)
    if setup.qlora:
        why = f"{name} in 4-bit needs ~{single / GIB:.1f} GiB per card, {usable:.1f} GiB usable"
        why += "; 4-bit weights cannot be sharded"
        return ParallelPlan("ddp", gpus, f"does not fit: {why}", single, fits=False)
    if _fits(sharded, budget_bytes):
        why = (
            f"FSDP2: {name} needs ~{single / GIB:.1f} GiB on one card, {usable:.1f} GiB usable; sharded over {gpus} "
            f"GPUs each holds ~{sharded / GIB:.1f} GiB (weights are gathered one layer at a time)"
        )
        return ParallelPlan("fsdp", gpus, why, sharded)
    why = (
        f"does not fit: ~{single / GIB:.1f} GiB on one card, ~{sharded / GIB:.1f} GiB per card sharded over {gpus}; "
        "turn on QLoRA or lower tokens per batch"
    )
    return ParallelPlan("fsdp", gpus, why, sharded, fits=False)


def setup_for_run(config: RunConfig, can_offload: bool = True) -> TrainSetup:
    """The planner's view of a run's memory choices (per GPU: tokens per batch is per card). Automatic
    checkpointing is sized as its leanest mode (:func:`engine.hardware.checkpoint_choice.leanest_mode`): whether a
    card holds the run at all decides DDP against FSDP2, and the run then takes a faster mode where one fits."""
    mode = config.speed.checkpointing
    return TrainSetup(
        tokens=config.data.tokens_per_batch or GPU_TOKENS_PER_BATCH,  # automatic (0): the GPU's default
        qlora=config.model.qlora,
        lora_rank=config.lora.rank or MEMORY_RANK,
        checkpointing=checkpoint_choice.leanest_mode(can_offload) if mode == "auto" else mode,
    )


def choose_for_run(
    config: RunConfig,
    gpus: int,
    budget_bytes: int,
    compute_capability: tuple[int, int] | None = (9, 0),
    can_offload: bool = True,
) -> ParallelPlan:
    """:func:`choose_parallel` for a run's config; an unknown model shape falls back to DDP with a reason.
    ``can_offload``: False on a GPU whose layer inputs cannot go to host memory (an integrated-memory GPU)."""
    from engine.errors import TuneDeckError

    try:
        shape: ModelShape | None = load_shape(config.model.name)
    except TuneDeckError:
        shape = None
    return choose_parallel(
        shape,
        setup_for_run(config, can_offload),
        gpus,
        budget_bytes,
        requested=config.training.parallel,
        compute_capability=compute_capability,
    )
