"""Turning a packed row into the keyword arguments of a transformers model, on the stock path.

transformers isolates packed documents by itself when it gets ``position_ids`` that restart at each document,
but only when ``attention_mask is None`` and no KV cache exists, so training must pass ``use_cache=False``
(with a cache, documents silently attend to each other: 0.46 max logit difference measured). gpt-oss never
hands ``position_ids`` to its mask builder and has no SDPA path, so it gets explicit additive masks, one per
layer type. This is the baseline the speed optimizations are measured against.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.data.packing import PackedBatch

# Model types whose mask creation ignores packed position_ids: they need explicit per-layer-type masks.
EXPLICIT_MASK_MODEL_TYPES = frozenset({"gpt_oss"})


def block_causal_mask(
    document_ids: torch.Tensor, *, sliding_window: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A (1, 1, T, T) mask where token q sees token k iff same document and k <= q (and within the window).

    With ``dtype`` the mask is additive (0 where allowed, the dtype's minimum elsewhere), as eager attention
    adds it to the scores; without, it is boolean (True where allowed), as SDPA takes it.
    """
    ids = document_ids.reshape(-1)
    positions = torch.arange(ids.numel(), device=ids.device)
    allowed = (ids[:, None] == ids[None, :]) & (positions[None, :] <= positions[:, None])
    if sliding_window is not None:
        allowed &= positions[None, :] > positions[:, None] - sliding_window
    allowed = allowed[None, None]
    if dtype is None:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def explicit_mask_mapping(model_config: Any, batch: PackedBatch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One additive mask per layer type, for models that do not derive packed masks from position_ids."""
    layer_types = set(getattr(model_config, "layer_types", None) or ["full_attention"])
    window = getattr(model_config, "sliding_window", None)
    masks = {}
    for layer_type in layer_types:
        sliding = window if layer_type == "sliding_attention" else None
        masks[layer_type] = block_causal_mask(batch.document_ids, sliding_window=sliding, dtype=dtype)
    return masks


def stock_model_inputs(model: torch.nn.Module, batch: PackedBatch) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs)`` on transformers' own packed path (``batch`` on the model's device)."""
    inputs: dict[str, Any] = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "use_cache": False,
    }
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in EXPLICIT_MASK_MODEL_TYPES:
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        inputs["attention_mask"] = explicit_mask_mapping(config, batch, dtype)
    return inputs
