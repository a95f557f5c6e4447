"""Every speed setting's choice as one frozen, typed record: one field per speed setting.

:func:`engine.speed.decide.decide_plan` makes the whole record at once from typed facts (model, device, run so far);
:class:`engine.speed.SpeedController` installs it and replaces it, never changing it in place. Runs' events, the
app's Speed page, switch words and run summaries read the JSON form, :meth:`SpeedPlan.as_state`:
``{name: {"on": bool, "reason": str, ...}}``, ``{"mode": ..., "reason": ...}`` for checkpointing and MoE routing.

Checkpointing is the one choice several parts of TuneDeck make (the planner, ``tunedeck plan``, the run, its
out-of-memory fallback); its decision lives below this package, in :mod:`engine.hardware.checkpoint_choice`, so the
planner can call it too. Resident layers and chunked MLPs act only under checkpointing and follow its mode.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.hardware.checkpoint_choice import CheckpointPlan

__all__ = [
    "CheckpointPlan",
    "Choice",
    "Fp8Choice",
    "GraphsChoice",
    "LoraChoice",
    "MetadataChoice",
    "ModeChoice",
    "ResidentChoice",
    "SpeedPlan",
]


@dataclass(frozen=True)
class Choice:
    """A switch resolved on or off, and why."""

    on: bool
    reason: str

    def as_state(self) -> dict[str, Any]:
        return {"on": self.on, "reason": self.reason}


@dataclass(frozen=True)
class MetadataChoice:
    """The metadata cache, with the attention kernel it feeds (None when off)."""

    on: bool
    backend: str | None
    reason: str

    def as_state(self) -> dict[str, Any]:
        return {"on": self.on, "backend": self.backend, "reason": self.reason}


@dataclass(frozen=True)
class ModeChoice:
    """A setting with a mode rather than on/off (MoE routing)."""

    mode: str
    reason: str

    def as_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason}


@dataclass(frozen=True)
class LoraChoice:
    """The 16-bit LoRA path, with the groups of projections that share one A product."""

    on: bool
    reason: str
    groups: int

    def as_state(self) -> dict[str, Any]:
        return {"on": self.on, "reason": self.reason, "groups": self.groups}


@dataclass(frozen=True)
class Fp8Choice:
    """fp8 products with the frozen base weights, in the scope they run in (None when off)."""

    on: bool
    scope: str | None
    reason: str

    def as_state(self) -> dict[str, Any]:
        return {"on": self.on, "scope": self.scope, "reason": self.reason}


@dataclass(frozen=True)
class GraphsChoice:
    """Step graphs on or off, and whether automatic ones are on trial (a replay timed against an eager run)."""

    on: bool
    reason: str
    trial: bool = False

    def as_state(self) -> dict[str, Any]:
        return {"on": self.on, "reason": self.reason}


@dataclass(frozen=True)
class ResidentChoice:
    """How many layers keep their activations and skip the recompute."""

    layers: int
    reason: str

    @property
    def on(self) -> bool:
        return self.layers > 0

    def as_state(self) -> dict[str, Any]:
        return {"on": self.on, "layers": self.layers, "reason": self.reason}


@dataclass(frozen=True)
class SpeedPlan:
    """Every speed setting's resolved choice, in the order they are applied; None until first resolved."""

    metadata_cache: MetadataChoice | None = None
    cudnn_attention: Choice | None = None
    moe_routing: ModeChoice | None = None
    fused_loss: Choice | None = None
    checkpointing: CheckpointPlan | None = None
    chunked_mlp: Choice | None = None
    host_embedding: Choice | None = None
    lora_16bit: LoraChoice | None = None
    dequant_once: Choice | None = None
    fp8_base: Fp8Choice | None = None
    fused_kernels: Choice | None = None
    resident_layers: ResidentChoice | None = None
    step_graphs: GraphsChoice | None = None

    def as_state(self) -> dict[str, dict[str, Any]]:
        """The JSON form events and the app read: ``{name: {"on": ..., "reason": ...}}`` for each resolved one."""
        choices = ((spec.name, getattr(self, spec.name)) for spec in fields(self))
        return {name: choice.as_state() for name, choice in choices if choice is not None}

    def is_on(self, name: str) -> bool:
        """Whether setting ``name`` is resolved on (False while unresolved)."""
        choice = getattr(self, name)
        return bool(choice is not None and getattr(choice, "on", False))
