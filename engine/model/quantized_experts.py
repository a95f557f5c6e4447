"""MoE experts stored in 4-bit NF4, dequantized only while their layer runs.

transformers 5 keeps a MoE layer's experts as 3-D parameters (Qwen3-MoE: ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I]); bitsandbytes quantizes only ``nn.Linear``, so under plain QLoRA Qwen3-30B-A3B keeps
~57 GiB of bf16 experts. Here each 3-D weight is stored as NF4 (blocks of 64, double-quantized statistics, as the
4-bit linears): ~15 GiB for Qwen3-30B-A3B, and the 16-bit tensors are freed.

:class:`QuantizedExperts` wraps the model's own experts module. When the layer runs, a custom autograd function
dequantizes that layer's weights, hands them to the experts module as plain tensors and calls it, so routing goes
through whatever experts implementation is selected (transformers' loop, or TuneDeck's bincount and sync-free
routing in ``engine.speed.moe_routing``). The function saves only the layer's input, routing weights and expert
ids; its backward dequantizes again and recomputes the experts to get the input gradient. Cost: one layer's
16-bit experts alive at a time (1.2 GiB for Qwen3-30B-A3B), one dequantization in forward and one in backward,
and the experts' forward run once more in backward.

The experts are frozen and have no weight gradient: LoRA goes on the attention projections and whatever other
linear layers the model has, never on the 4-bit experts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch

BLOCKSIZE = 64
QUANT_TYPE = "nf4"
NESTED_BLOCKSIZE = 256


class ExpertWeightNF4(torch.nn.Module):
    """One 3-D expert weight in NF4: packed 4-bit codes and double-quantized block statistics, as buffers."""

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    offset: torch.Tensor
    nested_absmax: torch.Tensor
    nested_code: torch.Tensor

    def __init__(self, packed: torch.Tensor, state: Any) -> None:
        super().__init__()
        if state.state2 is None:
            raise ValueError("expert weights are stored with double-quantized statistics")
        self.shape = tuple(state.shape)
        self.dtype = state.dtype
        self.register_buffer("packed", packed)
        self.register_buffer("absmax", state.absmax)
        self.register_buffer("code", state.code)
        self.register_buffer("offset", torch.as_tensor(state.offset))
        self.register_buffer("nested_absmax", state.state2.absmax)
        self.register_buffer("nested_code", state.state2.code)

    def quant_state(self) -> Any:
        from bitsandbytes.functional import QuantState

        nested = QuantState(
            absmax=self.nested_absmax, code=self.nested_code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32
        )
        return QuantState(
            absmax=self.absmax,
            shape=torch.Size(self.shape),
            code=self.code,
            blocksize=BLOCKSIZE,
            quant_type=QUANT_TYPE,
            dtype=self.dtype,
            offset=self.offset,
            state2=nested,
        )

    def dequantize(self) -> torch.Tensor:
        """The weight in its 16-bit (or float32) dtype, freshly allocated."""
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.packed, self.quant_state(), quant_type=QUANT_TYPE)

    def storage_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers())

    def extra_repr(self) -> str:
        return f"shape={self.shape}, dtype={str(self.dtype).removeprefix('torch.')}, nf4 blocksize={BLOCKSIZE}"


def quantize_expert_weight(weight: torch.Tensor) -> ExpertWeightNF4:
    """NF4 storage for a 3-D expert weight, quantized on the weight's device; each expert fills whole blocks."""
    from bitsandbytes.functional import quantize_4bit

    if weight.dim() != 3:
        raise ValueError(f"expert weights are 3-D (experts, out, in); got shape {tuple(weight.shape)}")
    per_expert = weight.shape[1] * weight.shape[2]
    if per_expert % BLOCKSIZE:
        raise ValueError(
            f"each expert's {per_expert} weights must fill whole {BLOCKSIZE}-weight blocks, so that no block "
            "mixes two experts"
        )
    packed, state = quantize_4bit(
        weight.detach().contiguous(), blocksize=BLOCKSIZE, compress_statistics=True, quant_type=QUANT_TYPE
    )
    return ExpertWeightNF4(packed, state)


class _DequantizedExpertsCall(torch.autograd.Function):
    """The experts on dequantized weights; saves no 16-bit weight, dequantizes again in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_states: torch.Tensor,
        top_k_weights: torch.Tensor,
        top_k_index: torch.Tensor,
        experts: QuantizedExperts,
    ) -> torch.Tensor:
        ctx.experts = experts
        ctx.save_for_backward(hidden_states, top_k_weights, top_k_index)
        with experts.dequantized():
            return cast(torch.Tensor, experts.base(hidden_states, top_k_index, top_k_weights))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden_states, top_k_weights, top_k_index = ctx.saved_tensors
        wants_hidden, wants_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad(), ctx.experts.dequantized():
            hidden = hidden_states.detach().requires_grad_(wants_hidden)
            weights = top_k_weights.detach().requires_grad_(wants_weights)
            out = ctx.experts.base(hidden, top_k_index, weights)
            inputs = [tensor for tensor in (hidden, weights) if tensor.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad_output, allow_unused=True))
        grad_hidden = next(grads) if wants_hidden else None
        grad_weights = next(grads) if wants_weights else None
        return grad_hidden, grad_weights, None, None


class QuantizedExperts(torch.nn.Module):
    """A MoE layer's experts with their 3-D weights in NF4 (frozen; no LoRA on them).

    ``base`` is the model's own experts module without its 3-D weight parameters: it keeps the activation, the
    gate, any biases and the dispatch to the selected experts implementation. Each weight is an
    :class:`ExpertWeightNF4` child named ``nf4_<weight>`` (so that LoRA target names such as ``down_proj`` never
    match it).
    """

    def __init__(self, base: torch.nn.Module, weights: Mapping[str, ExpertWeightNF4]) -> None:
        super().__init__()
        self.base = base
        self.weight_names = tuple(weights)
        for name, weight in weights.items():
            self.add_module(f"nf4_{name}", weight)

    def nf4(self, name: str) -> ExpertWeightNF4:
        module = self.get_submodule(f"nf4_{name}")
        assert isinstance(module, ExpertWeightNF4)
        return module

    @contextmanager
    def dequantized(self) -> Iterator[None]:
        """The base module sees its weights as plain 16-bit tensors inside the block, and no longer after it."""
        for name in self.weight_names:
            setattr(self.base, name, self.nf4(name).dequantize())
        try:
            yield
        finally:
            for name in self.weight_names:
                delattr(self.base, name)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (hidden_states.requires_grad or top_k_weights.requires_grad):
            with self.dequantized():
                return cast(torch.Tensor, self.base(hidden_states, top_k_index, top_k_weights))
        # torch leaves Function.apply unannotated
        out: torch.Tensor = _DequantizedExpertsCall.apply(  # type: ignore[no-untyped-call]
            hidden_states, top_k_weights, top_k_index, self
        )
        return out

    def storage_bytes(self) -> int:
        return sum(self.nf4(name).storage_bytes() for name in self.weight_names)

    def dequantized_bytes(self) -> int:
        """The 16-bit weights one call holds while it runs."""
        total = 0
        for name in self.weight_names:
            weight = self.nf4(name)
            total += torch.Size(weight.shape).numel() * torch.empty((), dtype=weight.dtype).element_size()
        return total

    @property
    def num_experts(self) -> int:
        count: Any = self.base.num_experts  # a plain attribute, which torch types as Tensor | Module
        return int(count)


def is_experts_module(module: torch.nn.Module) -> bool:
    """A transformers experts module with its weights as 3-D parameters (not yet quantized)."""
    return hasattr(module, "has_gate") and hasattr(module, "num_experts") and bool(expert_weight_names(module))


def expert_weight_names(module: torch.nn.Module) -> list[str]:
    """The module's own 3-D weight parameters (``gate_up_proj``, ``down_proj``...); biases are 2-D and stay."""
    return [name for name, param in module.named_parameters(recurse=False) if param.dim() == 3]


def quantize_experts(experts: torch.nn.Module, weights: Mapping[str, torch.Tensor] | None = None) -> QuantizedExperts:
    """Quantize an experts module's 3-D weights (its own, or ``weights`` by name) and drop the 16-bit ones.

    ``experts`` may live on the meta device when ``weights`` are given: that is how a model is built without
    ever holding its 16-bit experts.
    """
    names = expert_weight_names(experts)
    stored: dict[str, ExpertWeightNF4] = {}
    for name in names:
        source = weights[name] if weights is not None else experts._parameters[name]
        assert source is not None
        expected = tuple(experts._parameters[name].shape)  # type: ignore[union-attr]
        if tuple(source.shape) != expected:
            raise ValueError(f"expert weight {name} has shape {tuple(source.shape)}; the model expects {expected}")
        stored[name] = quantize_expert_weight(source)
        del experts._parameters[name]
    return QuantizedExperts(experts, stored)


def experts_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, experts module) for every unquantized experts module of ``model``."""
    found = []
    for parent in model.modules():
        for attribute, child in parent.named_children():
            if not isinstance(parent, QuantizedExperts) and is_experts_module(child):
                found.append((parent, attribute, child))
    return found


def quantize_model_experts(model: torch.nn.Module) -> int:
    """Replace every experts module of ``model`` by its 4-bit version, one layer at a time; the count replaced."""
    replaced = experts_modules(model)
    for parent, attribute, experts in replaced:
        parent._modules[attribute] = quantize_experts(experts)
    return len(replaced)


def quantized_experts_of(model: torch.nn.Module) -> list[QuantizedExperts]:
    return [module for module in model.modules() if isinstance(module, QuantizedExperts)]


def linear_targets_outside_experts(model: torch.nn.Module) -> list[str]:
    """LoRA targets for 'all-linear' on a model with 4-bit experts: the names of its linear layers, head excluded.

    peft's 'all-linear' on a transformers MoE also adds the experts' and router's weights as ``target_parameters``;
    naming the linear layers keeps LoRA off the frozen 4-bit experts (and off the router that picks them).
    """
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    return sorted(
        {
            name.rpartition(".")[2]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
    )


def experts_notice(model: torch.nn.Module) -> str | None:
    """What a user is told when the model's experts are 4-bit (None when it has none)."""
    layers = quantized_experts_of(model)
    if not layers:
        return None
    stored = sum(layer.storage_bytes() for layer in layers) / (1 << 30)
    transient = max(layer.dequantized_bytes() for layer in layers) / (1 << 30)
    return (
        f"MoE experts in 4-bit NF4: {len(layers)} layers, {stored:.1f} GiB, dequantized one layer at a time "
        f"({transient:.2f} GiB while a layer runs); the experts are frozen: LoRA trains the attention projections "
        "and the other linear layers"
    )
