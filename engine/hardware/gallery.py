"""The model gallery: popular models by family and size, what each downloads and how it trains on one card.

Each entry is a built-in shape of :mod:`engine.hardware.shapes` (or the demo model that ships with TuneDeck)
with the hub id a run loads. For a card, detected or taken from the GPU table, the memory planner says whether
the model trains with LoRA (16-bit base), only with QLoRA (4-bit base), or not at all, and the longest row it
trains with the plan's settings, exactly as ``tunedeck plan --model NAME`` would; its predicted peak is the
Automatic recipe's (:func:`engine.hardware.recipes.automatic_estimate`), the figure the Model and Recipe pages
show for it. Nothing is downloaded here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Literal

from engine.config import DEMO_MODEL, demo_model_dir
from engine.hardware.detect import HardwareInfo
from engine.hardware.profile import DeviceTarget, build_profile
from engine.hardware.recipes import RecipeEstimate, automatic_estimate
from engine.hardware.shapes import BUILTIN_CONFIGS, ModelShape

Verdict = Literal["LoRA", "QLoRA", "too big"]


@dataclass(frozen=True)
class GalleryModel:
    """One model the gallery offers."""

    key: str
    """A built-in shape name, or 'demo'."""
    hub_id: str
    """What a run loads: a Hugging Face hub id, or 'demo'."""
    family: str
    about: str
    expert_weight_bits: float = 16.0
    """Bits per expert weight in the published checkpoint (gpt-oss ships its experts in 4.25-bit MXFP4)."""
    gated: bool = False
    """The hub asks for an accepted licence and a token before the download."""

    @property
    def is_demo(self) -> bool:
        return self.hub_id == DEMO_MODEL


GALLERY: tuple[GalleryModel, ...] = (
    GalleryModel("demo", DEMO_MODEL, "Demo", "ships with TuneDeck: learns to write dates as ISO, in a minute on a CPU"),
    GalleryModel("qwen3-0.6b", "Qwen/Qwen3-0.6B", "Qwen3", "smallest Qwen3: quick experiments on any card"),
    GalleryModel("qwen3-1.7b", "Qwen/Qwen3-1.7B", "Qwen3", "small and capable"),
    GalleryModel("qwen3-4b", "Qwen/Qwen3-4B", "Qwen3", "a strong all-rounder for 8-12 GB cards"),
    GalleryModel("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3", "good quality, wants 16 GB or QLoRA"),
    GalleryModel("qwen3-14b", "Qwen/Qwen3-14B", "Qwen3", "high quality, 24 GB with QLoRA"),
    GalleryModel("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "Qwen3 MoE", "mixture of experts, 3B active per token"),
    GalleryModel("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "Llama 3", "small Llama", gated=True),
    GalleryModel("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "Llama 3", "mid-size Llama", gated=True),
    GalleryModel("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "Llama 3", "the classic 8B", gated=True),
    GalleryModel("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", "Mistral", "7B with a small vocabulary"),
    GalleryModel(
        "gpt-oss-20b", "openai/gpt-oss-20b", "gpt-oss", "mixture of experts, 4-bit experts", expert_weight_bits=4.25
    ),
)


def find_entry(name: str) -> GalleryModel | None:
    """The gallery entry a model name (hub id, shape name or 'demo') refers to, if any."""
    wanted = name.strip().lower()
    for entry in GALLERY:
        if wanted in (entry.hub_id.lower(), entry.key):
            return entry
    return None


def gallery_shape(entry: GalleryModel) -> ModelShape:
    if entry.is_demo:
        raw = json.loads((demo_model_dir() / "config.json").read_text(encoding="utf-8"))
        return ModelShape.from_config_dict(raw, DEMO_MODEL)
    return ModelShape.from_config_dict(BUILTIN_CONFIGS[entry.key], entry.key)


def download_bytes(entry: GalleryModel, shape: ModelShape) -> int:
    """The weights a run fetches from the hub: 16-bit safetensors (experts at the checkpoint's own width)."""
    if entry.is_demo:
        return 0
    experts = shape.num_layers * shape.expert_params_per_layer()
    rest = shape.total_params() - experts
    return int(rest * 2 + experts * entry.expert_weight_bits / 8)


@dataclass(frozen=True)
class Fit:
    """How one way of training (LoRA or QLoRA) goes on the card."""

    fits: bool
    peak_bytes: int
    budget_bytes: int
    longest_tokens: int | None
    reason: str
    tokens: int | None = None
    """The row the plan is for (the longest that fits its settings, up to 16,384 tokens)."""
    checkpointing: str = "none"
    memory: str = ""
    """What fills the peak, and why (engine.hardware.planner: the plan's 'memory' reason)."""


@dataclass(frozen=True)
class GalleryRow:
    entry: GalleryModel
    name: str
    params: int
    download_bytes: int
    lora: Fit | None
    qlora: Fit | None
    """None where QLoRA cannot run (on the CPU)."""
    automatic: RecipeEstimate | None = None
    """The Automatic recipe's figure the way the model trains (None: too big), as the Recipe page shows it."""

    @property
    def verdict(self) -> Verdict:
        if self.lora is not None and self.lora.fits:
            return "LoRA"
        if self.qlora is not None and self.qlora.fits:
            return "QLoRA"
        return "too big"

    @property
    def longest_tokens(self) -> int | None:
        """The longest row of the way it trains (LoRA when it fits, else QLoRA)."""
        best = {"LoRA": self.lora, "QLoRA": self.qlora}.get(self.verdict)
        return best.longest_tokens if best is not None else None


def plan_fit(target: DeviceTarget, shape: ModelShape, qlora: bool, min_tokens: int = 2048) -> Fit | None:
    """The planner's verdict for ``shape`` with LoRA or QLoRA forced (None: no memory figure for the target)."""
    profile = build_profile(target, shape, overrides={"qlora": qlora}, min_tokens=min_tokens)
    plan = profile.memory_plan
    if plan is None:
        return None
    reason = plan.reasons.get("fit") or plan.reasons.get("tokens_per_batch", "")
    return Fit(plan.fits, plan.estimate.peak, plan.budget_bytes, plan.longest_tokens, reason, plan.tokens,
               plan.checkpointing, plan.reasons.get("memory", ""))  # fmt: skip


def gallery_rows(target: DeviceTarget | HardwareInfo, min_tokens: int = 2048) -> list[GalleryRow]:
    """Every gallery model planned for ``target`` with rows of at least ``min_tokens`` tokens."""
    if isinstance(target, HardwareInfo):
        target = DeviceTarget.from_hardware(target)
    rows = []
    for entry in GALLERY:
        shape = gallery_shape(entry)
        lora = plan_fit(target, shape, qlora=False, min_tokens=min_tokens)
        qlora = plan_fit(target, shape, qlora=True, min_tokens=min_tokens) if target.is_gpu else None
        name = "Demo" if entry.is_demo else shape.display_name()
        row = GalleryRow(entry, name, shape.total_params(), download_bytes(entry, shape), lora, qlora)
        if row.verdict != "too big":
            row = replace(row, automatic=automatic_estimate(shape, target, qlora=row.verdict == "QLoRA"))
        rows.append(row)
    return rows
