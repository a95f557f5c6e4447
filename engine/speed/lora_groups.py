"""One LoRA A product per group of adapted projections that read the same input: q/k/v, and gate/up.

Why: a Llama-style layer feeds one normalised input to its q, k and v projections and another to gate and up.
With LoRA on each, every projection runs its own rank-r product ``x · Aᵀ``: a tall, thin matmul (4,096 tokens ×
4,096 in × 32 out for an 8B model at r32) that keeps the tensor cores mostly idle, and in backward its own input
gradient ``dh · A``, summed into the input's gradient one by one. Stacking the group's A weights makes one product
of 3r (or 2r) columns instead, and one input-gradient product. Measured alone (H200, Llama-3.1-8B shapes, 4,096
tokens, r32, CUDA-graph replays; benchmarks/qlora_projection_groups_h200.md): about 8 ms of a step's forward pass,
recompute and backward over 32 layers. Inside whole QLoRA steps on the H200 it saved less, 1.5-5 ms of 365-372 ms
(Llama-3.1-8B under 8 GiB) and 3 ms of 595 ms (Qwen3-30B-A3B under 24 GiB), at the same peak and loss
(benchmarks/qlora_train_lora_groups_h200.md); never slower, so it is part of the 16-bit adapter path (the
``lora_16bit`` setting) rather than a setting of its own.

How: the projections stay separate peft modules, each called by the model on its own and in order (q, k, v; gate,
up), so the group shares its product through a small state object. The first member computes the stacked product
and keeps its slices; the others find the same input (the same tensor object) and take theirs; the last one clears
the state, so nothing outlives the call. A member called with any other input computes its own product, so a model
that feeds the members different inputs, or calls them in another order, stays exact. It works inside compiled
regions (Dynamo traces the state as a side effect and leaves it cleared) and under checkpointing (the recompute
repeats the same calls).

Where: the 16-bit adapter path (``lora_16bit``), plain LoRA without dropout, every member adapted with the same
single adapter. The B products, the frozen products and merging are unchanged; the stacked A weights are cast to
the input's dtype as each member's are, and gradients reach each float32 master through the stacking.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.speed.stand_in import seen_through

__all__ = ["GROUPS", "GROUP_ATTR", "LoraGroup", "LoraGroups", "find_groups"]

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections of one module that read the same input, by name (Llama, Qwen, Mistral and their relatives)."""
GROUP_ATTR = "_tunedeck_lora_group"
"""Attribute of a member LoRA layer: (its group, its place in the group)."""


class LoraGroup:
    """The members of one group and, between the first and last member's call, the stacked product's slices."""

    def __init__(self, members: Sequence[Any], adapter: str) -> None:
        self.members = list(members)
        self.adapter = adapter
        self.input: torch.Tensor | None = None
        self.hidden: tuple[torch.Tensor, ...] | None = None

    def hidden_for(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """``x · A_indexᵀ`` for member ``index``: the first member computes the group's stacked product and keeps it
        for the others called with the same ``x``; a member called with another input computes its own; the last
        member clears what was kept."""
        if index == 0:
            weights = [self._weight(member) for member in self.members]
            stacked = torch.cat([w.to(x.dtype) for w in weights])
            self.hidden = F.linear(x, stacked).split([w.shape[0] for w in weights], dim=-1)
            self.input = x
        if self.input is x and self.hidden is not None:
            hidden = self.hidden[index]
        else:
            hidden = F.linear(x, self._weight(self.members[index]).to(x.dtype))
        if index == len(self.members) - 1:
            self.clear()
        return hidden

    def _weight(self, member: Any) -> torch.Tensor:
        weight: torch.Tensor = member.lora_A[self.adapter].weight
        return weight

    def clear(self) -> None:
        self.input, self.hidden = None, None


def find_groups(model: torch.nn.Module, adapted: Iterator[tuple[Any, str]]) -> list[LoraGroup]:
    """The groups whose every member is adapted here (``adapted``: (layer, adapter) pairs) with the same single
    adapter and no dropout."""
    usable = {id(layer): name for layer, name in adapted if len(layer.lora_A) == 1 and _no_dropout(layer, name)}
    groups = []
    for module in model.modules():
        for names in GROUPS:
            members = [_own(getattr(module, name, None)) for name in names]
            adapters = {usable.get(id(member)) for member in members}
            adapter = adapters.pop() if len(adapters) == 1 else None
            if adapter is not None:
                groups.append(LoraGroup(members, adapter))
    return groups


def _own(member: Any) -> Any:
    return seen_through(member) if isinstance(member, torch.nn.Module) else member


def _no_dropout(layer: Any, adapter: str) -> bool:
    return isinstance(layer.lora_dropout[adapter], torch.nn.Identity)


def group_hidden(module: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The member's ``x · Aᵀ`` through its group, or None when it has none."""
    entry: tuple[LoraGroup, int] | None = getattr(module, GROUP_ATTR, None)
    if entry is None:
        return None
    group, index = entry
    return group.hidden_for(index, x)


class LoraGroups:
    """Installs (on) or removes (off) the shared A products on every group of one model's 16-bit adapters."""

    def __init__(self) -> None:
        self.groups: list[LoraGroup] = []

    def install(self, model: torch.nn.Module, adapted: Iterator[tuple[Any, str]]) -> int:
        """Group the adapters once (the groups stay while on, so compiled regions keep their graphs); the number of
        groups."""
        if self.groups:
            return len(self.groups)
        self.groups = find_groups(model, adapted)
        for group in self.groups:
            for index, member in enumerate(group.members):
                setattr(member, GROUP_ATTR, (group, index))
        return len(self.groups)

    def remove(self) -> None:
        for group in self.groups:
            group.clear()
            for member in group.members:
                if hasattr(member, GROUP_ATTR):
                    delattr(member, GROUP_ATTR)
        self.groups = []
