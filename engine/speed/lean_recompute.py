"""Leaner recompute of frozen base projections: outputs nobody reads are skipped, 4-bit weights dequantized once.

Why: under offloaded checkpointing each decoder layer runs three times per step (forward without gradients, the
recompute in backward, then backward itself), and with a 4-bit (QLoRA) base every frozen projection dequantizes
its NF4 weight to 16 bits in each of them. Profiled on the H200 (Llama-3.1-8B shape, NF4, LoRA r32, one
4,096-token row, offloaded checkpointing): matmuls 255 ms, dequantization 26 ms of a 592 ms step. Two parts of
that work are wasted:

* **Unread outputs** (always, under offloaded checkpointing): an offloaded layer's recompute only has to rebuild
  what its operations save for their gradients; its output is thrown away. The MLP's down projection feeds nothing
  but the residual sum that forms that output (Llama, Mistral, Qwen, Phi-3 layers; not Gemma-style layers that
  normalise the MLP's output), so its frozen base matmul, 27% of a Llama-3.1-8B layer's weights, need not run in the
  recompute. Here it returns uninitialised memory of the right shape, and its backward still computes the input
  gradient through the frozen weight. Exact: the gradients are bit-for-bit those of the full recompute. Alone it
  takes 22 ms of GPU time off the 8 GiB QLoRA row's floor (292 -> 270 ms, ``benchmarks/qlora_floor_h200.md``); no
  whole step measured it above noise, so it has no setting of its own (``checkpointing standard`` runs torch's
  full recompute).
* **Dequantize once** (``dequant_once``): in the recompute, a 4-bit projection dequantizes its weight, keeps the
  16-bit copy for its own backward a moment later, and backward uses it instead of dequantizing again. The copies
  live only while one layer recomputes and runs backward: about one layer's 16-bit projections (318 MB for
  Llama-3.1-8B without its down projection), so the switch is automatic only where that fits comfortably.

The first two act only inside the recompute of :class:`engine.speed.offloaded_checkpoint.ActivationOffloader`, which
sets its :class:`~engine.speed.offloaded_checkpoint.RecomputeFlag` around it; everywhere else (no checkpointing,
torch's own checkpoint, evaluation, the chunked MLP's per-chunk backward) the projection runs as the library wrote
it. The flag is a plain attribute so that compiled regions (the fused-kernels switch) guard on it instead of
breaking their graphs. The same stand-ins carry the fp8-base switch
(:mod:`engine.speed.fp8_base`), which acts in every pass and on every frozen projection; inside the recompute it
keeps the fp8 weight for backward when dequantize-once is on. The frozen projections are wrapped in place like
:class:`engine.speed.chunked_mlp.TokenChunked` does: the stand-in shares the wrapped module's parameter and child
dictionaries, so names and saved adapters do not change, and switching off puts the library's module back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import torch
import torch.nn.functional as F

from engine.speed import four_bit_weights, fp8_base
from engine.speed.chunked_mlp import feeds_residual_only
from engine.speed.fused_kernels import decoder_layers
from engine.speed.offloaded_checkpoint import RecomputeFlag
from engine.speed.stand_in import StandIn

__all__ = [
    "FrozenProjection",
    "LeanRecompute",
    "dequant_once_resolve",
    "frozen_projections",
    "layer_dequant_bytes",
]

DEQUANT_FREE_SHARE = 0.10
"""Automatic dequantize-once only while one layer's 16-bit copies take at most this share of free memory."""


def is_4bit(module: torch.nn.Module) -> bool:
    """A bitsandbytes 4-bit linear layer (NF4 or FP4) itself, not a LoRA layer around one."""
    if not type(module).__module__.startswith("bitsandbytes"):
        return False
    weight = getattr(module, "weight", None)
    return type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None


def _is_frozen_linear(module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    if is_4bit(module):
        return True
    weight = getattr(module, "weight", None)
    return type(module) is torch.nn.Linear and isinstance(weight, torch.Tensor) and not weight.requires_grad


class _UnreadOutput(torch.autograd.Function):
    """``x @ W.T`` whose value nobody reads: forward only allocates, backward gives ``grad @ W``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, quant_state: Any, out_features: int) -> torch.Tensor:
        ctx.weight, ctx.quant_state = weight, quant_state
        return x.new_empty((*x.shape[:-1], out_features))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dense = four_bit_weights.dense_weight(ctx.weight, ctx.quant_state, grad.dtype)
        return grad @ dense, None, None, None


class _Decoded(torch.autograd.Function):
    """``x @ W.T + b`` for a frozen 4-bit weight decoded here and multiplied by cuBLAS (bitsandbytes' products).

    ``keep``: the 16-bit weight stays for the input gradient (dequantize-once); otherwise backward decodes again,
    as bitsandbytes does.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, quant_state: Any, bias: torch.Tensor | None, keep: bool
    ) -> torch.Tensor:
        dense = four_bit_weights.dense_weight(weight, quant_state, x.dtype)
        ctx.keep, ctx.quant_state = keep, quant_state
        ctx.save_for_backward(dense if keep else weight)
        return F.linear(x, dense, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (saved,) = ctx.saved_tensors
        dense = saved if ctx.keep else four_bit_weights.dense_weight(saved, ctx.quant_state, grad.dtype)
        return grad @ dense.to(grad.dtype), None, None, None, None


FP8_SCALES = ("fp8_scale_out", "fp8_scale_in")
"""Buffer names of a frozen projection's e4m3 weight scale, laid out for its two products, while the fp8-base
switch is on (never saved)."""


class FrozenProjection(StandIn):
    """Stands in for a frozen base projection (``nn.Linear`` or bitsandbytes ``Linear4bit``), names unchanged."""

    wrapped: torch.nn.Linear

    def __init__(self, wrapped: torch.nn.Linear, flag: RecomputeFlag, output_unread: bool) -> None:
        super().__init__(wrapped)
        self.flag = flag
        self.output_unread = output_unread
        """The output only feeds the layer's residual sum, which an offloaded layer's recompute throws away."""
        self.skip_unread = False
        self.dequant_once = False
        self.one_pass = False
        """fp8 weights straight from the 4-bit codes in one kernel (engine.speed.four_bit_weights), where it applies."""
        self.fp8_in_forward = True
        """With the fp8-base switch on: fp8 in the forward pass too; False keeps the forward pass (the loss) in
        16 bits and multiplies in fp8 only in an offloaded layer's recompute and backward."""
        self.quantized = is_4bit(wrapped)
        self.out_features = int(getattr(wrapped, "out_features", 0))
        self.in_features = int(getattr(wrapped, "in_features", 0))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            return cast(torch.Tensor, self.wrapped(x, *args, **kwargs))
        recompute = self.flag.active
        unread = recompute and self.skip_unread and self.output_unread
        if self.fp8_columns is not None and (recompute or self.fp8_in_forward):
            return self._fp8(x, keep=recompute and self.dequant_once, unread=unread)
        if unread:
            # torch leaves Function.apply unannotated
            out: torch.Tensor = _UnreadOutput.apply(  # type: ignore[no-untyped-call]
                x, *self._weight_and_state(), self.out_features
            )
            return out
        if recompute and self.dequant_once and self.quantized:
            return self._decoded(x, keep=True)
        return cast(torch.Tensor, self.wrapped(x))

    def set_fp8(self, on: bool, one_pass: bool = False) -> None:
        """Multiply in fp8 from the next call (its weight's scale read once here), or in 16-bit again.

        ``one_pass``: a 4-bit weight the one-pass kernel covers goes to e4m3 without its 16-bit copy.
        """
        _, state = self._weight_and_state()
        self.one_pass = bool(on and one_pass and state is not None and four_bit_weights.covers(state))
        if not on or not fp8_base.fits(self.in_features, self.out_features):
            for name in FP8_SCALES:
                self._buffers.pop(name, None)  # shared with the wrapped module
                for module in (self, self.wrapped):
                    module._non_persistent_buffers_set.discard(name)
        elif self.fp8_columns is None:
            with torch.no_grad():
                dense = four_bit_weights.dense_weight(*self._weight_and_state(), self._compute_dtype())
                columns = fp8_base.weight_columns(dense)
            for name, value in zip(FP8_SCALES, columns, strict=True):
                # buffers (compiled regions take them as inputs), never saved with the model
                self.register_buffer(name, value, persistent=False)
                self.wrapped._non_persistent_buffers_set.add(name)

    @property
    def fp8_columns(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's e4m3 scale for its forward and input-gradient products while the fp8-base switch is on
        (engine.speed.fp8_base.weight_columns); None: 16-bit."""
        out, into = (self._buffers.get(name) for name in FP8_SCALES)
        return None if out is None or into is None else (out, into)

    def _compute_dtype(self) -> torch.dtype:
        dtype = getattr(self.wrapped, "compute_dtype", None) or self.wrapped.weight.dtype
        return dtype if dtype.is_floating_point and dtype.itemsize == 2 else torch.bfloat16

    def _fp8(self, x: torch.Tensor, keep: bool, unread: bool) -> torch.Tensor:
        weight, state = self._weight_and_state()
        compute = self._compute_dtype()
        columns_out, columns_in = self.fp8_columns  # type: ignore[misc]
        # torch leaves Function.apply unannotated
        out: torch.Tensor = fp8_base.Fp8Projection.apply(  # type: ignore[no-untyped-call]
            x.to(compute), weight, state, self.wrapped.bias, columns_out, columns_in, keep, unread, self.one_pass
        )
        return out.to(x.dtype)

    def _weight_and_state(self) -> tuple[torch.Tensor, Any]:
        weight = self.wrapped.weight
        return weight, getattr(weight, "quant_state", None) if self.quantized else None

    def _decoded(self, x: torch.Tensor, keep: bool) -> torch.Tensor:
        compute = getattr(self.wrapped, "compute_dtype", None) or x.dtype
        weight, state = self._weight_and_state()
        # torch leaves Function.apply unannotated
        out: torch.Tensor = _Decoded.apply(  # type: ignore[no-untyped-call]
            x.to(compute), weight, state, self.wrapped.bias, keep
        )
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{type(self.wrapped).__name__}, output unread in recompute: {self.output_unread}"


def _dense_mlp(layer: torch.nn.Module) -> torch.nn.Module | None:
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None
    wrapped = getattr(mlp, "wrapped", mlp)  # under the chunked-MLP switch
    names = set(dict(wrapped.named_children()))
    return wrapped if {"gate_proj", "up_proj", "down_proj"} <= names or {"gate_up_proj", "down_proj"} <= names else None


def frozen_projections(
    hf_model: torch.nn.Module, every: bool = False
) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Linear, bool]]:
    """(parent, attribute, frozen linear, output unread in recompute) for every frozen projection of the decoder
    layers that either part can act on: the base layer under a LoRA adapter, or a frozen linear that has none.
    ``every``: all frozen projections, as the fp8-base switch acts on each of them."""
    for layer in decoder_layers(hf_model):
        mlp = _dense_mlp(layer)
        down = getattr(mlp, "down_proj", None) if mlp is not None and feeds_residual_only(layer) else None
        for owner in layer.modules():
            for name, child in list(owner.named_children()):
                base = child.wrapped if isinstance(child, FrozenProjection) else child
                if not _is_frozen_linear(base):
                    continue
                unread = down is not None and (owner is down or (owner is mlp and name == "down_proj"))
                if unread or every or is_4bit(base):
                    yield owner, name, base, unread


def layer_dequant_bytes(hf_model: torch.nn.Module) -> int:
    """16-bit bytes of one decoder layer's 4-bit projections whose outputs are read in recompute: what
    dequantize-once keeps alive at a time (the average over layers)."""
    total = sum(base.in_features * base.out_features * 2 for _, _, base, unread in frozen_projections(hf_model)
                if is_4bit(base) and not unread)  # fmt: skip
    return total // max(1, len(decoder_layers(hf_model)))


def dequant_once_resolve(
    requested: bool | None, checkpointing: str, extra_bytes: int, free_bytes: int | None
) -> tuple[bool, str]:
    """(on, reason): automatic where one layer's 16-bit copies take at most :data:`DEQUANT_FREE_SHARE` of the
    free GPU memory (``free_bytes`` None: no limit known)."""
    if requested is False:
        return False, "switched off: 4-bit weights are dequantized again for each gradient"
    if extra_bytes == 0:
        return False, "no 4-bit projections to dequantize"
    if checkpointing != "offloaded":
        return False, f"only inside offloaded checkpointing's recompute (checkpointing is {checkpointing})"
    how = f"4-bit weights dequantized once per recompute and reused by backward (+{extra_bytes / 2**20:,.0f} MiB)"
    if requested:
        return True, f"switched on; {how}"
    if free_bytes is not None and extra_bytes > DEQUANT_FREE_SHARE * free_bytes:
        return False, (
            f"automatic: off; one layer's 16-bit weights ({extra_bytes / 2**20:,.0f} MiB) would crowd the free GPU "
            f"memory ({free_bytes / 2**30:.1f} GiB)"
        )
    return True, f"automatic: {how}"


@dataclass
class LeanRecompute:
    """Installs the frozen-projection stand-ins on one model and sets what they do; safe between steps."""

    hf_model: torch.nn.Module
    flag: RecomputeFlag
    installed: list[tuple[torch.nn.Module, str, FrozenProjection]] = field(default_factory=list)
    every: bool = False
    """Stand-ins on every frozen projection (the fp8 switch acts on each), not only those lean recompute needs."""
    fp8_in_forward: bool = True
    """With the fp8 switch on, fp8 in the forward pass as well as in the recompute and backward
    (FrozenProjection.fp8_in_forward)."""

    def switch(self, skip_unread: bool, dequant_once: bool, fp8: bool = False, one_pass: bool = False) -> None:
        """Skip unread outputs in the recompute, dequantize once, multiply in fp8; ``one_pass`` lets fp8 weights come
        from 4-bit codes in one kernel."""
        if not (skip_unread or dequant_once or fp8):
            self.remove()
            return
        if fp8 and not self.every:
            self.remove()
        if not self.installed:
            self.install(every=fp8)
        for _, _, wrapper in self.installed:
            wrapper.skip_unread, wrapper.dequant_once = skip_unread, dequant_once
            wrapper.fp8_in_forward = self.fp8_in_forward
            wrapper.set_fp8(fp8, one_pass)

    def install(self, every: bool = False) -> None:
        for owner, name, base, unread in list(frozen_projections(self.hf_model, every)):
            wrapper = FrozenProjection(base, self.flag, output_unread=unread)
            owner._modules[name] = wrapper
            self.installed.append((owner, name, wrapper))
        self.every = every

    def fp8_projections(self) -> tuple[int, int, int]:
        """(in fp8, of those with e4m3 weights from 4-bit codes in one pass, frozen projections installed)."""
        on = [w for _, _, w in self.installed if w.fp8_columns is not None]
        return len(on), sum(w.one_pass for w in on), len(self.installed)

    def remove(self) -> None:
        for owner, name, wrapper in self.installed:
            owner._modules[name] = wrapper.wrapped
        self.installed.clear()
        self.every = False
