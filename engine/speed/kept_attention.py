"""Kept attention: under offloaded checkpointing, backward recomputes only the MLPs.

Why: offloaded checkpointing keeps one tensor per layer and recomputes the whole layer in backward. For a 4-bit
Llama-3.1-8B on one 4,096-token row under an 8 GiB cap on the H200 that recompute cost 1.31-1.36x the step without
checkpointing (411-427 against 313 ms): the q/k/v/o projections with their 4-bit dequantization, rotary, the
attention kernel and the MLP's gate and up projections all ran twice. The attention block's share of that is cheap
to keep instead: what its operations save for backward (the normalised input, q, k, v, the attention output and
the norms' inputs) is about 7 x tokens x hidden bytes per layer, while the MLP's gate/up/activation outputs are
three times the MLP width per token. So with this switch each layer runs with gradients, everything its
operations save goes to pinned host memory as one group per layer (copied on a side stream while the next
layer computes, at most two layers in flight), and the MLP is a recompute unit that keeps only its input
(:meth:`engine.speed.chunked_mlp.ChunkedModules.install_units`). In backward a layer's group comes back while the
layer above runs backward, and only the MLP recomputes (its down projection skipped there by lean recompute).

Cost: host<->device copies, which run on the copy engines beside compute. They pay where compute is slow next to
the bus, which is every consumer card: per token and layer, forward copies ~53 KB (Llama-3.1-8B) while computing
~0.44 GFLOP, so a PCIe 4.0 RTX 4090 (~25 GB/s, ~150 TFLOP/s) spends ~0.36x its forward time copying and a
PCIe 5.0 RTX 5090 ~0.5x; the H200 (55 GB/s measured, ~650 TFLOP/s) is the worst case. Pinned host memory holds
every layer's group (about 6.5 GiB for that 8B row), so the switch is automatic only where that fits the pinned
budget, and where two layers' groups fit easily in free GPU memory (one in use, one arriving).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEVICE_FREE_SHARE", "layer_saved_bytes", "resident_rotary", "resolve"]

DEVICE_FREE_SHARE = 0.25
"""Automatic only while two layers' saved tensors take at most this share of free GPU memory."""
SAVED_PER_TOKEN_HIDDEN = 7
"""Tensors of hidden width a layer saves per token: both norms' inputs and outputs, q, the attention output,
and one more for q/k norms or odd layouts (measured sizes replace the estimate after the first step)."""


def layer_saved_bytes(config: Any, tokens: int, dtype_bytes: int = 2) -> int:
    """Estimated bytes one decoder layer saves for backward on ``tokens`` tokens (its attention block and its
    MLP's input)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    kv_dim = int(getattr(config, "num_key_value_heads", 0) or heads) * head_dim
    return tokens * (SAVED_PER_TOKEN_HIDDEN * hidden + 2 * kv_dim) * dtype_bytes


def resolve(
    requested: bool | None,
    checkpointing: str,
    device: torch.device,
    *,
    step_bytes: int,
    layer_bytes: int,
    pinned_left: int,
    free_bytes: int | None,
) -> tuple[bool, str]:
    """(on, reason). ``step_bytes``/``layer_bytes``: what all layers / one layer save for backward on the longest
    row so far; ``pinned_left``: pinned host memory still free in the offloader's budget; ``free_bytes``: free GPU
    memory (None: unknown)."""
    if requested is False:
        return False, "switched off: offloaded checkpointing recomputes whole layers"
    if checkpointing != "offloaded":
        return False, f"only under offloaded checkpointing (checkpointing is {checkpointing})"
    how = f"backward recomputes only the MLPs; attention activations in host memory ({step_bytes / 2**30:.1f} GiB)"
    if requested:
        return True, f"switched on; {how}"
    if device.type != "cuda":
        return False, "automatic: off without a CUDA GPU (no recompute to save)"
    if step_bytes > pinned_left:
        return False, (
            f"automatic: off; the layers' saved tensors ({step_bytes / 2**30:.1f} GiB) exceed the pinned host memory "
            f"left ({pinned_left / 2**30:.1f} GiB)"
        )
    if free_bytes is not None and 2 * layer_bytes > DEVICE_FREE_SHARE * free_bytes:
        return False, (
            f"automatic: off; two layers' saved tensors ({2 * layer_bytes / 2**20:,.0f} MiB) would crowd free GPU "
            f"memory ({free_bytes / 2**30:.1f} GiB)"
        )
    return True, f"automatic: {how}"


def resident_rotary(hf_model: torch.nn.Module, keep: Callable[..., None]) -> Any:
    """Hook the model's rotary embedding so that its cos/sin tables, which every layer saves, stay on the device;
    returns the hook handle (None for models without one)."""
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    if not isinstance(rotary, torch.nn.Module):
        return None

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        keep(*(output if isinstance(output, tuple) else (output,)))

    return rotary.register_forward_hook(hook)
