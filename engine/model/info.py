"""What TuneDeck knows about a model before loading it: family, size, dense or MoE, and the planner's verdict.

Only the model's ``config.json`` is read (engine.model.hub: a local folder, the cache, a built-in shape, or the one
file fetched when the user asked for a hub id), so inspecting a 70B model takes a moment, not a download.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import DEMO_MODEL

GIB = 1 << 30


@dataclass(frozen=True)
class ModelInfo:
    """A model as the model page and the recipe page see it."""

    name: str
    family: str
    total_params: int
    is_moe: bool
    verdict: str
    """'fits', 'needs QLoRA', 'too big' or 'unknown'."""
    verdict_reason: str
    settings: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Planner choices for this machine: setting -> (value in words, reason)."""
    shape: Any = None
    """engine.hardware.shapes.ModelShape"""
    profile: Any = None
    """engine.hardware.profile.DeviceProfile"""
    automatic: Any = None
    """engine.hardware.recipes.RecipeEstimate: the Automatic recipe's figure, the one the gallery shows."""


def verdict_of(profile: Any, automatic: Any = None) -> tuple[str, str]:
    """The plan's verdict and its reason: fits, needs QLoRA, too big, or unknown without a memory figure. The peak
    said is the Automatic recipe's (``automatic``, an engine.hardware.recipes.RecipeEstimate) where given: the
    figure the gallery and the Recipe page show for the model."""
    from engine.hardware.recipes import describe_peak

    plan = profile.memory_plan
    if plan is None:
        return "unknown", "no memory figure for this device"
    peak = f"predicted peak {plan.estimate.gib():.1f} GiB of {plan.budget_bytes / GIB:.1f} GiB usable"
    if automatic is not None and describe_peak(automatic):
        peak = f"predicted peak {describe_peak(automatic)} with the Automatic recipe"
    if not plan.fits:
        return "too big", str(plan.reasons.get("fit", "does not fit"))
    if plan.qlora:
        return "needs QLoRA", f"{plan.reasons.get('qlora', '')}; {peak}"
    return "fits", f"{plan.reasons.get('qlora', '')}; {peak}"


def inspect_model(name: str, hardware: Any = None) -> ModelInfo:
    """Read the model's shape and plan it for ``hardware`` (detected now when None)."""
    from engine.hardware.profile import build_profile
    from engine.hardware.recipes import automatic_estimate
    from engine.hardware.shapes import load_shape
    from engine.model.hub import model_config_path

    shape = load_shape(str(model_config_path(name)))
    if hardware is None:
        from engine.hardware.detect import detect_hardware

        hardware = detect_hardware()
    profile = build_profile(hardware, shape)
    plan = profile.memory_plan
    automatic = None if plan is None or not plan.fits else automatic_estimate(shape, hardware, qlora=plan.qlora)
    verdict, reason = verdict_of(profile, automatic)
    settings = {key: (_shown(choice.value), choice.reason) for key, choice in profile.choices().items()}
    family = "demo (llama)" if name == DEMO_MODEL else shape.model_type
    return ModelInfo(name, family, shape.total_params(), shape.is_moe, verdict, reason, settings, shape, profile,
                     automatic)  # fmt: skip


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
