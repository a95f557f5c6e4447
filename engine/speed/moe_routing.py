"""MoE expert routing by sorting tokens by expert: argsort + bincount, and a sync-free grouped_mm variant.

transformers 5.x keeps a MoE layer's experts as 3-D parameters. Its eager loop asks the GPU which experts were
hit and then slices tokens per expert, a device->host sync per expert (641 syncs and 80 ms per block at 8k tokens,
Qwen3-30B-A3B shape). Here token->expert pairs are sorted once so each expert's tokens are one contiguous slice:

* ``bincount``: argsort on the device, counts from one copy of the expert ids to the host (CUDA ``bincount``
  itself would synchronise twice, for its min and max), then each expert runs on its slice. One sync per layer,
  and it works for every dtype and GPU: it is the path for fp16 and for RTX/GB10, where ``grouped_mm`` falls back
  to a synchronising per-group loop anyway.
* ``sync-free``: the sorted ids are counted on the device (``searchsorted``), the offsets never leave it, and
  torch's ``grouped_mm`` runs all experts in one kernel where it has a fast path (bf16 on sm_90/sm_100/sm_103).
  Elsewhere it loops over the offsets like bincount.

Both are registered with transformers' ExpertsInterface, so LoRA on the experts (peft ``target_parameters``,
which parametrises the 3-D weights) goes through them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.hardware.moe_choice import auto_moe_routing

BINCOUNT_NAME = "tunedeck_bincount"
SYNC_FREE_NAME = "tunedeck_sync_free"
MODES = ("stock", "bincount", "sync-free")
IMPLEMENTATION_NAMES = {"bincount": BINCOUNT_NAME, "sync-free": SYNC_FREE_NAME}


@dataclass(frozen=True)
class Routing:
    """Token->expert pairs sorted by expert."""

    order: torch.Tensor
    """(S,) indices into the flattened (tokens × top_k) pairs, sorted by expert (stable)."""
    token_index: torch.Tensor
    """(S,) the token each sorted pair comes from."""
    offsets: torch.Tensor | None
    """(E,) int32 end offset of each expert's slice, on the device (sync-free)."""
    sizes: list[int] | None
    """Per-expert slice lengths on the host (bincount)."""


def route_tokens_by_expert(top_k_index: torch.Tensor, num_experts: int, *, host_counts: bool) -> Routing:
    """Sort token->expert pairs by expert and count them, on the host (one sync) or on the device (none)."""
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    if host_counts:
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids.to("cpu"), minlength=num_experts)  # the one device->host copy
        return Routing(order, order // top_k, None, counts[:num_experts].tolist())
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    bounds = torch.arange(num_experts, device=expert_ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)
    return Routing(order, order // top_k, offsets, None)


def grouped_mm_fast_path(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped_mm runs as one kernel here (otherwise it loops per group after a sync)."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")) or dtype != torch.bfloat16:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in ((9, 0), (10, 0), (10, 3))


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, weight, offs=offsets)
    return torch._grouped_mm(x, weight, offs=offsets)


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    routing: Routing,
    bias: torch.Tensor | None,
    expert_of_row: torch.Tensor | None,
    transposed: bool,
) -> torch.Tensor:
    """Each expert's weight applied to its contiguous slice of ``x`` (rows sorted by expert).

    ``weight`` is (E, out, in), or (E, in, out) when ``transposed``; ``bias`` is (E, out).
    """
    w = weight if transposed else weight.transpose(-2, -1)  # (E, in, out)
    if routing.offsets is not None and grouped_mm_fast_path(x.device, x.dtype) and w.dtype == x.dtype:
        out = _grouped_mm(x, w, routing.offsets)
        if bias is not None:
            out = out + bias[expert_of_row]
        return out
    sizes = routing.sizes if routing.sizes is not None else _sizes_from_offsets(routing.offsets)
    return _looped_linear(x, w, bias, sizes)


def _sizes_from_offsets(offsets: torch.Tensor | None) -> list[int]:
    assert offsets is not None
    ends = offsets.tolist()  # a sync: only where grouped_mm has no fast path
    return [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _looped_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> torch.Tensor:
    outs = []
    # unbind, not w[expert]: indexing a 3-D parameter per expert makes backward build a full-size zero gradient
    # for every expert (128 × the weight's size for Qwen3-30B-A3B); unbind's backward stacks them once.
    weights = w.unbind(0)
    biases = bias.unbind(0) if bias is not None else None
    for expert, rows in enumerate(x.split(list(sizes))):
        if rows.shape[0] == 0:
            continue
        y = rows @ weights[expert]
        outs.append(y if biases is None else y + biases[expert])
    if not outs:
        return x.new_zeros(0, w.shape[-1])
    return torch.cat(outs)


def _expert_of_row(routing: Routing, top_k_index: torch.Tensor) -> torch.Tensor:
    return top_k_index.reshape(-1)[routing.order]


def run_sorted_experts(
    experts: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    routing: Routing,
) -> torch.Tensor:
    """The experts' MLP on tokens grouped by expert, weighted and summed back per token."""
    num_tokens, top_k = top_k_index.shape
    has_bias = getattr(experts, "has_bias", False)
    transposed = getattr(experts, "is_transposed", False)
    needs_ids = has_bias and routing.offsets is not None
    expert_of_row = _expert_of_row(routing, top_k_index) if needs_ids else None
    x = hidden_states[routing.token_index]
    if getattr(experts, "has_gate", True):
        up_weight, up_bias = experts.gate_up_proj, getattr(experts, "gate_up_proj_bias", None)
    else:
        up_weight, up_bias = experts.up_proj, getattr(experts, "up_proj_bias", None)
    h = grouped_linear(x, up_weight, routing, up_bias if has_bias else None, expert_of_row, transposed)
    h = experts._apply_gate(h) if getattr(experts, "has_gate", True) else experts.act_fn(h)
    down_bias = experts.down_proj_bias if has_bias else None
    h = grouped_linear(h, experts.down_proj, routing, down_bias, expert_of_row, transposed)
    if getattr(experts, "has_post_expert_norm", False):
        h = experts.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1)[routing.order].unsqueeze(-1).to(h.dtype)
    # Back to (token, k) order with a gather (its backward is a plain scatter), then sum over k.
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=routing.order.device)
    out = h[inverse].view(num_tokens, top_k, -1).sum(dim=1)
    return out.to(hidden_states.dtype)


def bincount_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts implementation: argsort + host bincount (one sync per layer), each expert on its slice."""
    routing = route_tokens_by_expert(top_k_index, self.num_experts, host_counts=True)
    return run_sorted_experts(self, hidden_states, top_k_index, top_k_weights, routing)


def sync_free_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts implementation: sort + searchsorted offsets kept on the device, grouped_mm where it is fast.

    Where grouped_mm has no fast path its fallback would read the offsets back anyway, so the counts are taken on
    the host once (the bincount path) rather than once per projection."""
    fast = grouped_mm_fast_path(hidden_states.device, hidden_states.dtype)
    routing = route_tokens_by_expert(top_k_index, self.num_experts, host_counts=not fast)
    return run_sorted_experts(self, hidden_states, top_k_index, top_k_weights, routing)


def register_experts_implementations() -> None:
    """Register both implementations with transformers' ExpertsInterface (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(BINCOUNT_NAME, bincount_experts_forward)
    ExpertsInterface.register(SYNC_FREE_NAME, sync_free_experts_forward)


def has_routable_experts(model: torch.nn.Module) -> bool:
    """Whether the model has transformers 3-D expert modules that dispatch through the ExpertsInterface."""
    return any(_is_experts_module(m) for m in model.modules())


def _is_experts_module(module: torch.nn.Module) -> bool:
    # has_gate is set by transformers' experts decorator only; 4-bit experts (engine.model.quantized_experts) keep
    # it on their base module, whose 3-D weights are attached only while the layer runs
    return hasattr(module, "has_gate") and hasattr(module, "num_experts")


def resolve_mode(
    requested: str,
    has_experts: bool,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: str,
    fast: bool,
) -> tuple[str, str]:
    """(mode, reason) for a model with or without routable experts on a device; ``dtype`` e.g. "bfloat16", ``fast``:
    :func:`grouped_mm_fast_path`. 'auto' follows engine.hardware.moe_choice (as the profile does)."""
    if not has_experts:
        return "stock", "no MoE expert layers in this model"
    where = f"{device_type} {dtype}"
    if requested == "auto":
        return auto_moe_routing(True, device_type == "cuda", capability, dtype)
    if requested == "sync-free" and not fast:
        return "sync-free", f"sync-free requested; grouped_mm has no fast path on {where}: experts loop (one sync)"
    return requested, f"{requested} requested"


def experts_implementation_of(model: Any) -> Any:
    return model.config._experts_implementation
