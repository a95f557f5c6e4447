"""A model in words for the Model, Recipe and guide bar: where it would train, the verdict's target, the plan's
paragraphs (longest row, what fills the memory, layers kept resident, notes) and a parameter count.

The facts come from the engine (engine.model.info.inspect_model); this module only words them.
"""

from __future__ import annotations

from typing import Any

from engine.model.info import ModelInfo


def machine_name(hardware: Any) -> str:
    """Where a run would train, in a few words: the GPU by name ("the RTX 4090"), or "this computer's CPU" on a
    machine without a usable GPU. ``hardware``: a HardwareInfo, or a DeviceTarget taken from the GPU table."""
    gpu = getattr(hardware, "primary", hardware)
    name = getattr(gpu, "name", None)
    if gpu is None or not name or getattr(hardware, "gpu_class", "") == "cpu":
        return "this computer's CPU"
    return f"the {name.removeprefix('NVIDIA ')}"


def verdict_target(info: ModelInfo) -> str:
    """What the verdict is for: the GPU by name, or the computer when the run would be on the CPU."""
    profile = info.profile
    if profile is None or getattr(profile, "device", "cpu") != "cuda":
        return "this computer (CPU)"
    return f"this GPU ({profile.gpu_name})" if profile.gpu_name else "this GPU"


def longest_row_html(info: ModelInfo) -> str:
    """A paragraph on the longest row this model trains on this device, or "" when the planner has none."""
    plan = getattr(info.profile, "memory_plan", None)
    reason = plan.reasons.get("longest") if plan is not None else None
    return f"<p>Longest row that trains here: {reason}</p>" if reason else ""


def memory_html(info: ModelInfo) -> str:
    """A paragraph on what fills the predicted peak (weights, adapter, activations, loss) for the planned row, or ""
    when the planner has no such figure: a small model that fits without recompute can plan more than a big one."""
    plan = getattr(info.profile, "memory_plan", None)
    reason = plan.reasons.get("memory") if plan is not None else None
    return f"<p>What fills the memory: {reason}.</p>" if reason else ""


def resident_layers_html(info: ModelInfo) -> str:
    """A paragraph on the layers that skip the recompute in this GPU's spare memory, or "" when there are none."""
    plan = getattr(info.profile, "memory_plan", None)
    reason = plan.reasons.get("resident_layers") if plan is not None else None
    return f"<p>Faster in the memory left: {reason}.</p>" if reason else ""


def plan_notes_html(info: ModelInfo) -> str:
    """The plan's notes for this model on this GPU (fp8 tensor cores, faster shorter rows), one paragraph each."""
    notes = getattr(info.profile, "notes", ()) or ()
    return "".join(f"<p>Note: {note}.</p>" for note in notes)


def format_params(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)
