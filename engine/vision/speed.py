"""Which speed switches a vision-language run can use, and why the others stay off.

The switches of :mod:`engine.speed` are built around the packed text path: one row of documents, varlen attention
over ``cu_seqlens``, a loss over the language model's last hidden states. A vision-language forward merges image
features into the embeddings inside the model and builds its own image-attention masks, so those switches cannot
see its rows. Activation checkpointing is the exception: transformers' own (non-reentrant) recompute runs through
the language model and the vision tower alike, and ``speed.checkpointing`` standard or offloaded turns it on.
"""

from __future__ import annotations

import torch

from engine.config import SpeedConfig

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


def checkpointing_on(speed: SpeedConfig, device: torch.device) -> bool:
    """transformers' recompute: when asked for, and on a GPU by default (where memory is short), never on a CPU."""
    if speed.checkpointing in ("standard", "offloaded"):
        return True
    return speed.checkpointing == "auto" and device.type == "cuda"


def speed_notes(speed: SpeedConfig, device: torch.device) -> list[str]:
    """One line for the switches this run cannot use (those the user turned on are named with their reason)."""
    asked = [name for name in REASONS if getattr(speed, name, None) is True]
    notes = [f"{name.replace('_', ' ')} is off for vision-language models: {REASONS[name]}" for name in asked]
    recompute = "on (transformers' recompute)" if checkpointing_on(speed, device) else "off"
    if speed.checkpointing == "offloaded":
        recompute += "; offloaded checkpointing is a packed-text switch, so activations stay on the GPU"
    notes.append(
        "speed: activation checkpointing " + recompute + "; the packed-text switches (fused loss, chunked MLP, "
        "fused kernels, resident layers, step graphs) do not apply to image rows"
    )
    return notes
