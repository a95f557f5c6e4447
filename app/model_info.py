"""What the app shows about a model before loading it: family, size, dense or MoE, and the planner's verdict.

Only the model's ``config.json`` is read (for a hub id: from the local cache, or fetched alone when online), so
inspecting a 70B model takes a moment, not a download. Qt-free; runs in a background thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import DEMO_MODEL
from engine.errors import ModelLoadError

GIB = 1 << 30


@dataclass(frozen=True)
class ModelInfo:
    """A model as the model page and the setup page see it."""

    name: str
    family: str
    total_params: int
    is_moe: bool
    verdict: str
    """'fits', 'needs QLoRA' or 'too big'."""
    verdict_reason: str
    settings: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Planner choices for this GPU: setting -> (value, reason)."""
    shape: Any = None
    profile: Any = None


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


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")


def model_config_path(name: str) -> Path | str:
    """A local config.json for the model, or a built-in shape name the planner knows (gallery models included)."""
    from engine.hardware.gallery import find_entry
    from engine.hardware.shapes import builtin_shape_names
    from engine.model.load import resolve_model

    entry = find_entry(name)
    if entry is not None and not entry.is_demo and not Path(name).expanduser().exists():
        return entry.key

    source = resolve_model(name)
    if source.is_local:
        return Path(source.location)
    if name.lower().rsplit("/", 1)[-1] in builtin_shape_names():
        return name
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")  # on disk only: a fetched model is never looked up again
    if isinstance(cached, str):
        return Path(cached)
    try:  # a hub id the user typed and asked for ("downloaded now"); offline, the error says so
        return Path(hf_hub_download(name, "config.json", local_files_only=_offline()))
    except Exception as err:
        raise _hub_error(name, err) from err


DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
"""What training needs from a hub repository: configs, safetensors weights, tokenizer files (never pickles)."""

Progress = Callable[[str, float, float | None], None]
"""(what, done, total) — e.g. ("Fetching 9 files", 3, 9) or ("model.safetensors", 1.2e9, 3.4e9)."""


def progress_bar_class(report: Progress) -> type:
    """A tqdm class that forwards every update to ``report`` instead of drawing, for huggingface_hub."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = False
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 (closed with the bar)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            report(str(self.desc or "downloading"), float(self.n), float(self.total) if self.total else None)
            return shown

        def close(self) -> None:
            super().close()
            self.fp.close()

    return Reporting


def download_model(name: str, report: Progress) -> Path:
    """Fetch a hub model's training files into the Hugging Face cache (or find them there when offline)."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=_offline(),
                                   tqdm_class=progress_bar_class(report))  # fmt: skip
    except Exception as err:
        raise _hub_error(name, err) from err
    return Path(str(folder))


def _hub_error(name: str, err: Exception) -> ModelLoadError:
    if _offline():
        return ModelLoadError(
            f"'{name}' is not in the local Hugging Face cache and offline mode is on",
            hint="download it once while online, or unset HF_HUB_OFFLINE",
        )
    return ModelLoadError(
        f"cannot read '{name}' from the hub: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
        hint="check the model id and your network; gated models need a Hugging Face token",
    )


def verdict_of(profile: Any) -> tuple[str, str]:
    plan = profile.memory_plan
    if plan is None:
        return "unknown", "no memory figure for this device"
    peak = f"predicted peak {plan.estimate.gib():.1f} GiB of {plan.budget_bytes / GIB:.1f} GiB usable"
    if not plan.fits:
        return "too big", plan.reasons.get("fit", "does not fit")
    if plan.qlora:
        return "needs QLoRA", f"{plan.reasons.get('qlora', '')}; {peak}"
    return "fits", f"{plan.reasons.get('qlora', '')}; {peak}"


def inspect_model(name: str, hardware: Any = None) -> ModelInfo:
    """Read the model's shape and plan it for ``hardware`` (detected now when None)."""
    from engine.hardware.profile import build_profile
    from engine.hardware.shapes import load_shape

    shape = load_shape(str(model_config_path(name)))
    if hardware is None:
        from engine.hardware.detect import detect_hardware

        hardware = detect_hardware()
    profile = build_profile(hardware, shape)
    verdict, reason = verdict_of(profile)
    settings = {key: (_shown(choice.value), choice.reason) for key, choice in profile.choices().items()}
    family = "demo (llama)" if name == DEMO_MODEL else shape.model_type
    return ModelInfo(name, family, shape.total_params(), shape.is_moe, verdict, reason, settings, shape, profile)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_params(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)
