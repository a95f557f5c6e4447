"""LoRA adapters computed in the model's 16-bit dtype, with their float32 weights kept as the master copy.

Why: peft keeps the adapter weights in float32 when the base model is bf16/fp16 (so small updates are not
rounded away) and then runs the whole A/B path in float32: every adapted projection casts its input to a
float32 copy (kept for the backward pass), runs two float32 matmuls, adds a float32 (tokens x out) update to the
16-bit base output and rounds the sum back. At 16k tokens that is a 4-byte copy of every layer input per adapted
projection: for Llama-3.1-8B with all seven projections adapted, ~147 KB per token and layer against ~45 KB when
the 16-bit inputs are shared, and a third of the memory traffic of a Llama-3.2-1B step on the H200.

How: each adapter gets a peft LoRA variant (peft's extension point for DoRA and friends) whose forward casts the
small A and B weights to the input's dtype inside the graph and adds ``B(A(x)) * scale`` to the base output in
that dtype; the input cast peft would do first is switched off with peft's own ``cast_input_dtype_enabled``
flag. The matmuls accumulate in float32 (cuBLAS, Triton); gradients flow back through the casts into the
float32 weights, so the optimizer still updates float32 masters, as mixed-precision training does.

Cost: the adapter's activations and gradients round to 16 bits, as the base model's already do; losses follow the
float32 path within bf16 noise. Nothing to do for float32 models (the switch reports that). Merging an adapter
into its base weights is unchanged. Switching off removes the variants and restores peft's flag.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from engine.speed.lora_groups import group_hidden
from engine.speed.stand_in import own_modules

__all__ = ["Lora16Bit", "adapted_layers", "resolve", "unsupported_reason"]

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def adapted_layers(model: torch.nn.Module) -> Iterator[tuple[Any, str]]:
    """(layer, adapter name) of every plain (vanilla) LoRA adapter on a linear projection in the model."""
    from peft.tuners.lora.layer import LoraLayer

    for module in own_modules(model):
        if not isinstance(module, LoraLayer) or not hasattr(module, "lora_A"):
            continue
        for name, lora_a in module.lora_A.items():
            plain = name not in module.lora_variant or isinstance(module.lora_variant[name], _variant_class())
            if plain and isinstance(lora_a, torch.nn.Linear):
                yield module, name


def unsupported_reason(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why the switch has nothing to do for this model (None when it applies)."""
    if dtype not in SIXTEEN_BIT:
        return f"the model computes in {str(dtype).removeprefix('torch.')}: the adapters already match it"
    if next(adapted_layers(model), None) is None:
        return "the model has no plain LoRA adapters on linear layers"
    return None


def resolve(requested: bool | None, model: torch.nn.Module, dtype: torch.dtype) -> tuple[bool, str]:
    """(on, reason) for this model in ``dtype`` (:func:`resolve_from`)."""
    return resolve_from(requested, unsupported_reason(model, dtype))


def resolve_from(requested: bool | None, problem: str | None) -> tuple[bool, str]:
    """(on, reason): automatic is on wherever it applies (``problem``: :func:`unsupported_reason`)."""
    if requested is False:
        return False, "switched off: peft's float32 adapter path (float32 copies of each adapted input)"
    if problem is not None:
        return False, problem
    how = "LoRA A/B path in 16-bit with float32 master weights, adapted inputs shared"
    return True, f"automatic: {how}" if requested is None else f"switched on; {how}"


def lora_update(x: torch.Tensor, lora_a: torch.nn.Linear, lora_b: torch.nn.Linear, scale: float) -> torch.Tensor:
    """``B(A(x)) * scale`` in ``x``'s dtype, from float32 (or any dtype) adapter weights."""
    return lora_b_update(F.linear(x, lora_a.weight.to(x.dtype)), lora_b, scale)


def lora_b_update(hidden: torch.Tensor, lora_b: torch.nn.Linear, scale: float) -> torch.Tensor:
    """``B(hidden) * scale`` in ``hidden``'s dtype."""
    bias = None if lora_b.bias is None else lora_b.bias.to(hidden.dtype)
    return F.linear(hidden, lora_b.weight.to(hidden.dtype), bias) * scale


def _delta(module: Any, adapter: str, like: torch.Tensor) -> torch.Tensor:
    delta: torch.Tensor = module.get_delta_weight(adapter)
    return delta.to(like.dtype)


@functools.cache
def _variant_class() -> type:
    """peft's LoRA variant interface, implemented once per process (peft is imported on first use)."""
    from peft.tuners.lora.layer import LoraVariant

    class Variant(LoraVariant):
        """Plain LoRA whose forward runs in the input's dtype; merging is plain LoRA's."""

        @staticmethod
        def init(module: Any, adapter_name: str, **kwargs: Any) -> None:
            return None

        @staticmethod
        def merge_safe(module: Any, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            return orig_weight + _delta(module, active_adapter, orig_weight)

        @staticmethod
        def merge_unsafe(module: Any, active_adapter: str, orig_weight: torch.Tensor) -> None:
            orig_weight.data += _delta(module, active_adapter, orig_weight)

        @staticmethod
        def unmerge(module: Any, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
            return orig_weight - _delta(module, active_adapter, orig_weight)

        @staticmethod
        def forward(module: Any, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs: Any) -> Any:
            lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
            scale = module.scaling[active_adapter]
            hidden = group_hidden(module, x)  # this adapter's A product, shared with its group's (lora_groups)
            if hidden is None:
                update = lora_update(module.lora_dropout[active_adapter](x), lora_a, lora_b, scale)
            else:
                update = lora_b_update(hidden, lora_b, scale)
            return result + update.to(result.dtype)

    return Variant


class Lora16Bit:
    """Installs (on) or removes (off) the 16-bit adapter path on every plain LoRA adapter of one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._installed: list[tuple[Any, str, bool]] = []

    @property
    def on(self) -> bool:
        return bool(self._installed)

    def switch(self, on: bool) -> None:
        if on:
            self.install()
        else:
            self.remove()

    def install(self) -> None:
        if self._installed:
            return
        variant = _variant_class()()
        for layer, adapter in list(adapted_layers(self.model)):
            self._installed.append((layer, adapter, layer.cast_input_dtype_enabled))
            layer.lora_variant[adapter] = variant
            layer.cast_input_dtype_enabled = False

    def remove(self) -> None:
        for layer, adapter, cast_enabled in self._installed:
            layer.lora_variant.pop(adapter, None)
            layer.cast_input_dtype_enabled = cast_enabled
        self._installed.clear()
