"""What the pictures add to a run's memory: the vision tower's weights and the image tokens each example carries.

The planner (engine.hardware.planner) sizes text runs from the language model's shape and the tokens of a
micro-batch. A vision-language run adds the vision tower and projector (frozen: weights only, no optimizer state
unless ``vision.adapt_vision``) and, per image, the tower's activations over its patches and the image tokens the
language model then carries like text tokens. Those figures come from the model's config and the pixel budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.hardware.planner import MemoryEstimate, TrainSetup, estimate_memory
from engine.vision.families import MLLAMA, VisionFamily


@dataclass(frozen=True)
class VisionMemory:
    """The vision part of a run's memory, in bytes, and the image tokens one image adds to a row."""

    tower_params: int
    tower_bytes: int
    image_tokens: int
    """Tokens one image at the pixel budget adds to the language model's sequence (Mllama: cross-attention states)."""
    patches: int
    """Patches the vision tower runs over for one image (its own sequence length)."""
    activation_bytes: int
    """The tower's saved activations for one image (roughly 16 hidden-size tensors a layer per patch)."""


def tower_params(vision: Mapping[str, Any]) -> int:
    """Parameters of a ViT from its config: per layer 4 h^2 (attention) + 2 h x intermediate (MLP)."""
    hidden = int(vision.get("hidden_size", 0))
    inter = int(vision.get("intermediate_size", 4 * hidden))
    layers = int(vision.get("num_hidden_layers", vision.get("depth", 0))) + int(vision.get("num_global_layers", 0))
    return layers * (4 * hidden * hidden + 2 * hidden * inter)


def image_cost(config: Mapping[str, Any], family: VisionFamily, max_pixels: int) -> tuple[int, int]:
    """(image tokens, tower patches) one image at ``max_pixels`` costs."""
    vision = config.get("vision_config", {})
    patch = int(vision.get("patch_size", 14))
    if family.label.startswith("Qwen"):
        merge = int(vision.get("spatial_merge_size", 2))
        patches = max_pixels // (patch * patch)
        return patches // (merge * merge), patches
    side = int(vision.get("image_size", 224))
    per_tile = (side // patch) ** 2
    if family.label.startswith("Gemma"):
        return int(config.get("mm_tokens_per_image", 256)), per_tile
    if family.label.startswith("Llama"):
        tiles = min(int(vision.get("max_num_tiles", 4)), max(1, math.ceil(max_pixels / (side * side))))
        return tiles * (per_tile + 1), tiles * (per_tile + 1)
    tiles = min(17, max(1, math.ceil(max_pixels / (side * side)))) + (1 if max_pixels > side * side else 0)
    scale = int(config.get("scale_factor", 1))
    return tiles * per_tile // (scale * scale), tiles * per_tile


def vision_memory(config: Mapping[str, Any], family: VisionFamily, max_pixels: int, dtype_bytes: int) -> VisionMemory:
    """The vision tower's weights and one image's tokens and tower activations for a model's ``config``."""
    vision = config.get("vision_config", {})
    params = tower_params(vision)
    tokens, patches = image_cost(config, family, max_pixels)
    hidden = int(vision.get("hidden_size", 0))
    layers = int(vision.get("num_hidden_layers", vision.get("depth", 0)))
    return VisionMemory(params, params * dtype_bytes, tokens, patches, 16 * patches * hidden * layers * dtype_bytes)


UNCHECKPOINTED_LAYER_FACTOR = 1.55
"""What transformers' own decoder layers keep for backward without recompute, over the planner's figure for a
layer (which TuneDeck's packed text path keeps): measured on a Qwen2.5-VL-3B-shaped model on an H100 with
benchmarks/vision_h200.py, 18.3 GiB allocated at the peak against 15.2 GiB planned without the factor (its record,
benchmarks/vision_h100.json: 18.9 GiB reserved against 18.4 GiB planned with it). With recompute the plan is within
3% of the allocated peak."""


def vision_step_estimate(
    config: Mapping[str, Any],
    family: VisionFamily,
    setup: TrainSetup,
    *,
    images_per_row: int,
    max_pixels: int,
    adapt_vision: bool = False,
    image_tokens: int | None = None,
) -> MemoryEstimate:
    """The planner's estimate (engine.hardware.planner) for a padded micro-batch of ``setup.tokens`` text tokens and
    ``images_per_row`` images: the language model over text and image tokens (the stock loss over padded rows,
    no packed-text switches), plus the vision tower's weights, and its saved activations where LoRA adapts it (a
    frozen tower keeps none: nothing before it needs a gradient). ``image_tokens``: the row's own, where its
    examples are encoded (pictures smaller than the pixel budget carry fewer tokens than the budget's); otherwise
    each image counts the budget's."""
    from engine.hardware.shapes import ModelShape

    shape = ModelShape.from_config_dict(config, str(config.get("model_type", "vision")))
    part = vision_memory(config, family, max_pixels, setup.dtype_bytes)
    at_budget = images_per_row * part.image_tokens
    carried = at_budget if image_tokens is None else image_tokens
    carried = carried if family is not MLLAMA else 0  # Mllama: cross-attention states, not tokens in the row
    language = replace(setup, tokens=setup.tokens + carried, fused_loss=False, chunk_tokens=None, resident_layers=0)
    estimate = estimate_memory(shape, language)
    activations = estimate.activations
    if setup.checkpointing == "none":
        activations = round(activations * UNCHECKPOINTED_LAYER_FACTOR)
    share = 1.0 if image_tokens is None or not at_budget else image_tokens / at_budget
    tower = round(images_per_row * part.activation_bytes * share) if adapt_vision else 0
    parts = {**estimate.parts, "vision_tower": part.tower_bytes, "image_tokens": carried}
    return replace(estimate, weights=estimate.weights + part.tower_bytes, activations=activations + tower, parts=parts)
