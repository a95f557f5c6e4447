"""Which speed switches a vision-language run can use, and why the others stay off.

The switches of :mod:`engine.speed` are built around the packed text path: one row of documents, varlen attention
over ``cu_seqlens``, a loss over the language model's last hidden states. A vision-language forward merges image
features into the embeddings inside the model and builds its own image-attention masks, so those switches cannot
see its rows. Activation checkpointing is the exception: transformers' own (non-reentrant) recompute runs through
the language model and the vision tower alike. ``speed.checkpointing`` standard or offloaded turns it on, none turns
it off; automatic recomputes on a GPU only where the memory planner's peak without it (its largest micro-batch,
engine.vision.memory) does not fit the card with the planner's margin, as a text run chooses its checkpointing.
Recompute costs a second forward of the language model in every step; where memory is plenty, it buys nothing.
A step that runs out of memory all the same turns it on (engine.run.vision_guard).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeedConfig
from engine.hardware.planner import GIB, SAFETY_MARGIN

REASONS = {
    "fused_loss": "the loss comes from the model's own head over padded rows",
    "chunked_mlp": "it replaces the language model's MLPs on the packed text path only",
    "host_embedding": "image features are merged into the embeddings inside the model",
    "fused_kernels": "its compiled kernels are written for the packed text path",
    "dequant_once": "it serves the packed text path's QLoRA layers only",
    "resident_layers": "it manages the packed text path's recompute",
    "step_graphs": "image batches change shape every step (image sizes and counts), which CUDA graphs cannot replay",
    "metadata_cache": "padded rows carry no packing metadata to cache",
}


@dataclass(frozen=True)
class Recompute:
    """Whether transformers' recompute runs, and why."""

    on: bool
    why: str


def choose_recompute(mode: str, on_gpu: bool, peak_without: int | None, budget: int | None) -> Recompute:
    """Recompute for ``speed.checkpointing`` ``mode``: standard or offloaded always, none never, automatic on a GPU
    unless the planner's peak without recompute (``peak_without``) fits the usable memory (``budget``) with the
    planner's margin, and never on a CPU (whose memory is the computer's)."""
    if mode in ("standard", "offloaded"):
        return Recompute(True, f"asked for (--checkpointing {mode})")
    if mode != "auto":
        return Recompute(False, "turned off (--checkpointing none)")
    if not on_gpu:
        return Recompute(False, "not needed on the CPU")
    if peak_without is None or budget is None:
        return Recompute(True, "automatic: no memory plan for this model, so the safe choice")
    plan = f"the plan without it peaks at {peak_without / GIB:.1f} GiB of {budget / GIB:.1f} GiB usable"
    if peak_without * (1 + SAFETY_MARGIN) <= budget:
        return Recompute(False, f"automatic: {plan}")
    return Recompute(True, f"automatic: {plan}")


def speed_notes(speed: SpeedConfig, recompute: Recompute) -> list[str]:
    """One line for the switches this run cannot use (those the user turned on are named with their reason)."""
    asked = [name for name in REASONS if getattr(speed, name, None) is True]
    notes = [f"{name.replace('_', ' ')} is off for vision-language models: {REASONS[name]}" for name in asked]
    state = "on (transformers' recompute)" if recompute.on else "off"
    recompute_words = f"{state}, {recompute.why}"
    if speed.checkpointing == "offloaded":
        recompute_words += "; offloaded checkpointing is a packed-text switch, so activations stay on the GPU"
    notes.append(
        "speed: activation checkpointing " + recompute_words + "; the packed-text switches (fused loss, chunked MLP, "
        "fused kernels, resident layers, step graphs) do not apply to image rows"
    )
    return notes
