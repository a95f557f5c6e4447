"""Activation checkpointing, decided in one place: none, standard recompute, or offloaded to host memory.

Every part of TuneDeck that picks a checkpointing mode calls :func:`decide_checkpointing` with the facts it knows:
the planner (:func:`engine.hardware.planner.choose_memory_settings`, rows each mode fits from its memory estimate),
the device profile behind ``tunedeck plan`` / ``tunedeck detect`` (no model: a default for the device), and the
training run's :class:`engine.speed.SpeedController` (rows that fit from the GPU's free memory, decided again as rows
grow and after an out-of-memory step switches the setting to offloaded, engine.run.guard). It sits in
``engine.hardware`` because the planner is there and may not import ``engine.speed`` (tests/test_engine_layers.py).

The decision order, and why:

1. An explicit ``offloaded`` where offloading cannot work (an integrated-memory GPU, where host and device memory
   are one, or WSL's cap on pinned memory) becomes ``standard``: the memory saving the user asked for, by the one
   route the device has.
2. Any other explicit setting wins as given.
3. Automatic with no memory planned: no recompute on a CPU (host memory is plentiful, a recompute only costs time),
   standard recompute on a GPU (without a model to plan for, the safe choice).
4. Automatic with the rows each candidate mode fits: no recompute while its rows are as long as the wanted ones (or
   as long as the best mode's; a recompute costs ~30% of a step), else the mode that fits the longest rows,
   offloaded on a tie (it keeps less on the GPU). The candidates leave out offloaded where it cannot work
   (:func:`candidate_modes`).

Resident layers and chunked MLPs only act under checkpointing, so they are decided after it, from its mode
(engine.speed.resident_layers, engine.speed.chunked_mlp); the planner sizes both for the mode chosen here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Checkpointing = Literal["none", "standard", "offloaded"]
Requested = Literal["auto", "none", "standard", "offloaded"]

CPU_REASON = "CPU: host memory is plentiful, recompute would only cost time"
NO_MODEL_REASON = "without a model to plan for, recompute is the safe choice"
FITS_REASON = "activations fit in free GPU memory: no recompute needed"
OFFLOAD_REASON = "activations would not fit in free GPU memory: checkpoint and offload layer inputs"
RECOMPUTE_REASON = "activations would not fit in free GPU memory: layers recomputed in backward"


@dataclass(frozen=True)
class CheckpointFacts:
    """What the checkpointing decision needs: no tensors, no modules, so a table of these tests it."""

    on_gpu: bool
    offload_blocker: str | None = None
    """Why layer inputs cannot go to host memory here (integrated-memory GPU, WSL); None where they can."""
    fits: tuple[tuple[Checkpointing, int | None], ...] | None = None
    """Candidate modes in order of preference, each with the longest row it fits in tokens (None: no known limit);
    None where no memory was planned (a CPU run, a profile without a model)."""
    wanted_tokens: int = 0
    """The rows to fit: the longest row so far in a run, the preferred batch in the planner."""


@dataclass(frozen=True)
class CheckpointPlan:
    """The mode and why, in the words the run's events carry (``state["checkpointing"]``)."""

    mode: Checkpointing
    reason: str

    def as_state(self) -> dict[str, str]:
        return {"mode": self.mode, "reason": self.reason}


def candidate_modes(can_offload: bool) -> tuple[Checkpointing, ...]:
    """The modes an automatic decision weighs, in order of preference (offloaded only where it can work)."""
    return ("none", "offloaded", "standard") if can_offload else ("none", "standard")


def leanest_mode(can_offload: bool) -> Checkpointing:
    """The mode that keeps the least on the GPU: what sizing asks for when it must know whether a run fits at all
    (automatic checkpointing takes it when nothing else fits)."""
    return "offloaded" if can_offload else "standard"


def decide_checkpointing(facts: CheckpointFacts, requested: Requested = "auto") -> CheckpointPlan:
    """The checkpointing mode for ``facts`` when the user asked for ``requested`` (the module docstring's order)."""
    if requested == "offloaded" and facts.offload_blocker:
        return CheckpointPlan("standard", f"offloaded requested but {facts.offload_blocker}; plain recompute instead")
    if requested != "auto":
        return CheckpointPlan(requested, f"{requested} requested")
    if facts.fits is None:
        return CheckpointPlan("standard", NO_MODEL_REASON) if facts.on_gpu else CheckpointPlan("none", CPU_REASON)
    if not facts.fits:
        raise ValueError("no checkpointing mode fits: the caller says why nothing fits")
    mode = _mode_that_fits(facts.fits, facts.wanted_tokens)
    if mode == "none":
        return CheckpointPlan("none", FITS_REASON)
    if mode == "offloaded":
        return CheckpointPlan("offloaded", OFFLOAD_REASON)
    if facts.offload_blocker:
        return CheckpointPlan("standard", f"activations would not fit; {facts.offload_blocker}")
    return CheckpointPlan("standard", RECOMPUTE_REASON)


def _mode_that_fits(fits: tuple[tuple[Checkpointing, int | None], ...], wanted_tokens: int) -> Checkpointing:
    """No recompute when its rows reach the wanted ones (or the best mode's); else the mode fitting the longest rows,
    offloaded on a tie."""
    tokens: dict[Checkpointing, float] = {mode: math.inf if fit is None else fit for mode, fit in fits}
    best = max(tokens, key=lambda mode: (tokens[mode], mode == "offloaded"))
    if "none" in tokens and tokens["none"] >= min(wanted_tokens, tokens[best]):
        return "none"
    return best
