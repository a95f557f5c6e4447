"""The vision-language families TuneDeck trains, and where each keeps its language model, vision tower and projector.

transformers loads these as image-text-to-text models (``AutoModelForImageTextToText``). LoRA goes on the linear
layers of the language model by default; the vision tower and the projector stay frozen (``vision.adapt_vision``
adapts them too). Each family has a default pixel budget: a larger image is scaled down to it before the processor
sees it, so an 8-megapixel photo does not become thousands of image tokens. A config with a vision tower of any
other family is refused with the families TuneDeck knows: it is never trained with guessed module names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError


@dataclass(frozen=True)
class VisionFamily:
    """One family of vision-language models: its transformers model types and its module layout."""

    label: str
    model_types: tuple[str, ...]
    language: tuple[str, ...]
    """Module-name prefixes of the language model (LoRA targets by default)."""
    vision: tuple[str, ...]
    """Prefixes of the vision tower (frozen unless ``vision.adapt_vision``)."""
    projector: tuple[str, ...]
    """Prefixes of the projector from image features to the language model (frozen like the tower)."""
    max_pixels: int
    """Default pixel budget of one image (width x height after resizing)."""

    def part_of(self, module_name: str) -> str | None:
        """'language', 'vision' or 'projector' for a module of this family's models (None: none of them)."""
        for part, prefixes in (("projector", self.projector), ("vision", self.vision), ("language", self.language)):
            if any(module_name == p or module_name.startswith(p + ".") for p in prefixes):
                return part
        return None


QWEN_VL = VisionFamily(
    label="Qwen2-VL / Qwen2.5-VL / Qwen3-VL",
    model_types=("qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
    language=("model.language_model",),
    vision=("model.visual",),
    projector=("model.visual.merger", "model.visual.deepstack_merger_list"),
    max_pixels=1024 * 28 * 28,  # 1024 image tokens, Qwen's own recommendation for fine-tuning
)
GEMMA3 = VisionFamily(
    label="Gemma 3",
    model_types=("gemma3",),
    language=("model.language_model",),
    vision=("model.vision_tower",),
    projector=("model.multi_modal_projector",),
    max_pixels=896 * 896,  # SigLIP at 896x896: every image is resized to it anyway
)
IDEFICS3 = VisionFamily(
    label="Idefics3 / SmolVLM",
    model_types=("idefics3", "smolvlm"),
    language=("model.text_model",),
    vision=("model.vision_model",),
    projector=("model.connector",),
    max_pixels=1536 * 1536,  # the processor splits an image into 384x384 tiles, at most 4x4 of them
)
MLLAMA = VisionFamily(
    label="Llama 3.2 Vision (Mllama)",
    model_types=("mllama",),
    language=("model.language_model",),
    vision=("model.vision_model",),
    projector=("model.multi_modal_projector",),
    max_pixels=1120 * 1120,  # at most 4 tiles of 560x560
)
FAMILIES = (QWEN_VL, GEMMA3, IDEFICS3, MLLAMA)


def known_families() -> str:
    return ", ".join(family.label for family in FAMILIES)


def is_vision_config(config: Mapping[str, Any]) -> bool:
    """Whether a model's ``config.json`` describes a vision-language model (it has a vision tower)."""
    return "vision_config" in config or config.get("model_type") in _TYPES


_TYPES = {model_type: family for family in FAMILIES for model_type in family.model_types}


def family_of(config: Mapping[str, Any]) -> VisionFamily:
    """The family of a vision-language model's config; an unknown one is refused naming the known families."""
    model_type = str(config.get("model_type", "?"))
    family = _TYPES.get(model_type)
    if family is None:
        raise ModelLoadError(
            f"TuneDeck does not know how to train the vision-language model type '{model_type}'",
            hint=f"it trains these families: {known_families()}",
        )
    return family


def lora_targets(family: VisionFamily, module_names: Iterable[tuple[str, str]], adapt_vision: bool) -> list[str]:
    """The full names of the linear layers LoRA adapts: the language model's (never its output head), and with
    ``adapt_vision`` the vision tower's and projector's too. ``module_names``: (name, class name) pairs."""
    parts = {"language", "vision", "projector"} if adapt_vision else {"language"}
    return [
        name
        for name, kind in module_names
        if kind in _LINEAR_KINDS and family.part_of(name) in parts and not name.endswith("lm_head")
    ]


_LINEAR_KINDS = frozenset({"Linear", "Linear4bit"})


def frozen_parts(family: VisionFamily) -> tuple[str, ...]:
    """Module prefixes left in 16 bits under QLoRA: the vision tower and projector (small, and quantising them costs
    accuracy a frozen tower cannot win back)."""
    return (*family.vision, *family.projector)
