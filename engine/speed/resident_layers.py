"""Resident layers: under checkpointing, the layers that fit in spare GPU memory keep their activations and skip
the recompute.

Why: checkpointing is all or nothing in transformers. Once one step's activations do not fit, every layer keeps
only its input and runs its forward again in backward (the q/k/v/o, gate and up products, attention and the
per-token kernels a second time). On a card with room to spare, say 24 GiB where the checkpointed step peaks near
8 GiB, the rest of the memory sits idle while the recompute runs. This switch spends it: a share of the layers (spread
evenly over the depth, :func:`engine.hardware.planner.keeps_layer`) runs with gradients and keeps
everything it saves on the GPU, as without checkpointing; the others checkpoint as before.

How many: the most layers whose activations, on top of the checkpointed step's own peak, the memory planner
(:func:`engine.hardware.planner.estimate_memory`) predicts to fit the memory this process can use with its safety
margin, and at least those that leave that peak where it is. The planner predicts the peak from 1% below to 6%
above the measured one in the H200 benchmarks, and the margin covers the rest. It counts the top layer (always
resident) as freed before the layer below it recomputes, which is where a checkpointed step peaks, so that layer
is free: under an 8 GiB cap it skips its recompute at the same 7.22 GiB peak (364-368 ms a step against 373 ms,
benchmarks/qlora_train_top_layer_h200.md). The count is made again whenever the rows grow or a switch changes,
and a run that still runs short gives the resident layers up before anything else (:mod:`engine.run.step`).

Measured on the H200 (Llama-3.1-8B in 4-bit, one 4,096-token row, 24 GiB cap): 19 of 32 layers resident took the
step from 374 to 324 ms, at 17.2 GiB (benchmarks/qlora_resident_h200.md).

Exact: a resident layer runs the operations its recompute would have run, once, so the gradients are those of the
checkpointed path to float rounding (bit for bit on the CPU, where the same kernels run). Cost: memory only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.hardware.planner import keeps_layer, most_resident_layers, setup_from_speed_state
from engine.hardware.shapes import ModelShape

__all__ = ["LayerResidency", "planned_layers", "resolve"]

CheckpointFunction = Callable[..., Any]


@dataclass
class LayerResidency:
    """Which of a micro-batch's checkpointed layers run without checkpointing: ``share`` of them, spread evenly."""

    share: float = 0.0
    _index: int = 0

    def begin_batch(self) -> None:
        """Count layers from the bottom again: a new micro-batch's forward starts."""
        self._index = 0

    def wrap(self, checkpoint: CheckpointFunction) -> CheckpointFunction:
        """``checkpoint`` for layers that are not resident; resident ones run directly and keep what they save."""

        def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return checkpoint(function, *args, **kwargs)
            index = self._index
            self._index += 1
            if self.share > 0 and keeps_layer(index, self.share):
                return function(*args, **kwargs)
            return checkpoint(function, *args, **kwargs)

        return run


def planned_layers(
    model: torch.nn.Module,
    config: Any,
    state: Mapping[str, Mapping[str, Any]],
    tokens: int,
    budget_bytes: int,
    compute_capability: tuple[int, int] | None,
) -> int:
    """How many layers the planner fits beside a ``tokens``-token step with the speed switches in ``state`` within
    ``budget_bytes`` (:func:`engine.hardware.planner.most_resident_layers`). ``model``: the trained (peft) model,
    for its LoRA rank and whether its base is 4-bit; ``config``: its transformers config."""
    shape = ModelShape.from_config(config)
    return planned_layers_for(shape, is_4bit(model), lora_rank(model), state, tokens, budget_bytes, compute_capability)


def planned_layers_for(
    shape: ModelShape,
    qlora: bool,
    rank: int,
    state: Mapping[str, Mapping[str, Any]],
    tokens: int,
    budget_bytes: int,
    compute_capability: tuple[int, int] | None,
) -> int:
    """:func:`planned_layers` from the model's shape, whether its base is 4-bit and its LoRA rank."""
    setup = setup_from_speed_state(state, shape, tokens, qlora=qlora, lora_rank=rank)
    return most_resident_layers(shape, replace(setup, resident_layers=0), budget_bytes, compute_capability)


def is_4bit(model: torch.nn.Module) -> bool:
    """Whether the base holds bitsandbytes 4-bit weights (found by parameter: stand-ins hide the library's layers)."""
    return any(type(param).__name__ == "Params4bit" for param in model.parameters())


def lora_rank(model: torch.nn.Module) -> int:
    configs = getattr(model, "peft_config", None) or {}
    ranks = [int(getattr(config, "r", 0)) for config in configs.values()]
    return max(ranks, default=16) or 16


def resolve(
    requested: bool | None,
    checkpointing: str,
    *,
    layers: int,
    total: int,
    blocker: str | None = None,
    budget_bytes: int | None = None,
) -> tuple[int, str]:
    """(resident layers, reason). ``layers``: how many fit (:func:`planned_layers`, or a fixed count);
    ``blocker``: why none can be chosen here (no GPU memory figures, chunked MLPs), if so; ``budget_bytes``:
    the memory they were sized for, for the reason."""
    if requested is False:
        return 0, "switched off: checkpointing recomputes every layer"
    if checkpointing == "none":
        return 0, "only under checkpointing (checkpointing is none: every layer keeps its activations anyway)"
    how = "switched on" if requested else "automatic"
    if blocker is not None:
        return 0, f"{how}: off; {blocker}"
    within = f" ({budget_bytes / 2**30:.1f} GiB reachable)" if budget_bytes is not None else ""
    if layers <= 0:
        return 0, f"{how}: off; no spare GPU memory beside the checkpointed step{within}"
    return min(layers, total), (
        f"{how}: {min(layers, total)} of {total} layers keep their activations in spare GPU memory{within} and "
        "skip the recompute"
    )
