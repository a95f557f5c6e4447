"""Frozen base weights multiplied in fp8 (e4m3) on GPUs with fp8 tensor cores: ``--fp8-base all|recompute``.

Why: in 4-bit (QLoRA) fine-tuning of a 7-8B model the products with the frozen base weights are most of the
step: forward, the checkpointed recompute and the input gradients of backward. Profiled on the H200 (Llama-3.1-8B
shape, NF4, LoRA r32, one 4,096-token row, 8 GiB cap, automatic switches: 394 ms/step), GEMM kernels took 248 of
the 362 busy milliseconds. fp8 tensor cores (Ada, Hopper, Blackwell, GB10) run the same products about 1.7x as fast
(H200: 0.61 against 0.35 ms for a 4,096 x 4,096 x 14,336 product).

How: a frozen projection (4-bit or 16-bit, under its LoRA adapter or alone) dequantizes its weight as before and
scales it into e4m3 by one scale per weight, fixed for the run (the weights are frozen). Each input row, one
token, is scaled into e4m3 by its own largest value; ``torch._scaled_mm`` multiplies with float32 accumulation
and returns the model's 16-bit dtype. Backward gives the input gradient the same way: the output gradient's rows
in e4m3 against the transposed fp8 weight. The LoRA adapters, norms, attention, loss and optimizer keep their own
precision: only products with frozen weights change. Inside offloaded checkpointing's recompute, with
dequantize-once on, the transposed fp8 weight is kept for the layer's backward (1 byte per weight, half the bf16
copy dequantize-once keeps otherwise).

Cost: e4m3 keeps 3 mantissa bits, so each product carries about 4% relative error against bf16's 0.2% (random
4,096-wide rows). A 4-bit base already carries NF4's larger rounding in the weights themselves, and the trained
adapters stay in 16/32 bits, but with fp8 in the forward pass the losses no longer follow the bf16 path within
bf16 noise. Products whose widths are not multiples of 16 keep the 16-bit path, and so do MoE routers and 3-D
experts, which are not linear projections: experts are still chosen from 16-bit logits.

Scope (the ``fp8_base`` value): ``all`` as above, or ``recompute``: the forward pass stays in 16
bits, so the loss is the 16-bit path's, and only offloaded checkpointing's recompute and the input gradients
multiply in fp8. The gradients then come from activations rebuilt with fp8 products and carry fp8 rounding, which
is small beside a micro-batch's own sampling noise.

Automatic: on, in the ``recompute`` scope, for a dense model with a 4-bit (QLoRA) base under offloaded checkpointing
on a GPU with fp8 tensor cores; off elsewhere (fp8 everywhere, 16-bit bases and runs without a recompute were not
measured within bf16 noise, nor MoE models' speed with it). Measured on the H200 (Llama-3.1-8B QLoRA, r32, one
4,096-token row, 8 GiB cap): in one bench process, 20-step losses within 2.36e-4 of the float32-LoRA path, against
2.39e-4 for the 16-bit path and 2.9e-3 with fp8 everywhere; through ``tunedeck train``, automatic, 311 ms a step
(13,169 tokens/s) at a 6.97 GiB peak, against 361 ms (11,341 tokens/s) at 7.22 GiB in 16 bits, the loss after 40
steps 1.701 against 1.699 (``benchmarks/qlora_train_fp8_h200.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.speed.four_bit_weights import dense_weight, e4m3_from_4bit

__all__ = [
    "E4M3_MAX",
    "fp8_matmul",
    "frozen_weight_e4m3",
    "quantize_rows",
    "resolve",
    "scope_of",
    "scoped",
    "unavailable_reason",
    "weight_columns",
    "weight_scale",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448
"""The largest finite e4m3 value: each row (or weight) is scaled so its largest magnitude lands there. An int, as
compiled regions treat float globals as graph inputs."""
_PROBED: dict[str, str | None] = {}
"""Per-device result of :func:`_probe` (a plain dict, not ``functools.cache``: compiled code never reads it)."""


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor in e4m3 with one float32 scale per row: ``t ~= q * scale``, scale of shape (rows, 1)."""
    scale = _scale_of(t.abs().amax(dim=-1, keepdim=True))
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous(), scale


def weight_scale(weight: torch.Tensor) -> torch.Tensor:
    """The one float32 scale of a frozen weight in e4m3 (a 0-d tensor)."""
    return _scale_of(weight.abs().amax())


def weight_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen (out, in) weight's :func:`weight_scale` laid out as the per-column scales its two products take:
    (1, out) for forward and (1, in) for the input gradient, made once so no product builds them again."""
    scale = weight_scale(weight)
    out_features, in_features = weight.shape
    return scale.expand(1, out_features).contiguous(), scale.expand(1, in_features).contiguous()


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """float32 scale that maps ``amax`` onto :data:`E4M3_MAX`; never zero, so an all-zero row stays zero."""
    return (amax.float() / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A frozen (out, in) weight in e4m3 under its fixed :func:`weight_scale`."""
    return (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def fp8_matmul(
    rows: torch.Tensor, rows_scale: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``(rows * rows_scale) @ (weight * columns.T).T`` in ``dtype``: rows (M, K) and weight (N, K), both e4m3 and
    row-major; rows_scale (M, 1) and columns (1, N), float32 and contiguous."""
    return torch._scaled_mm(rows, weight.t(), scale_a=rows_scale, scale_b=columns, out_dtype=dtype)


def _dense(weight: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:
    return dense_weight(weight, quant_state, dtype)


def frozen_weight_e4m3(
    weight: torch.Tensor,
    quant_state: Any,
    dtype: torch.dtype,
    scale: torch.Tensor,
    rows_out: bool,
    transposed_out: bool,
    one_pass: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A frozen weight in e4m3 under its fixed ``scale``: (row-major (out, in) or None, transposed or None).

    ``one_pass``: a 4-bit weight the kernel covers goes straight from its codes
    (:mod:`engine.speed.four_bit_weights`); otherwise it is dequantized to ``dtype`` and cast.
    """
    if not (rows_out or transposed_out):
        return None, None
    if one_pass:
        return e4m3_from_4bit(weight, quant_state, scale, dtype, rows_out, transposed_out)
    w8 = quantize_weight(_dense(weight, quant_state, dtype), scale)
    return (w8 if rows_out else None), (w8.t().contiguous() if transposed_out else None)


class Fp8Projection(torch.autograd.Function):
    """``x @ W.T + b`` through a frozen weight in fp8; backward gives the input gradient in fp8 too.

    ``columns_out`` (1, out) and ``columns_in`` (1, in) hold the weight's one scale (:func:`weight_columns`).
    ``keep``: save the transposed fp8 weight for backward (inside a recompute that backward follows at once);
    otherwise backward dequantizes again. ``unread``: the output is never read (lean recompute), only its
    gradient is needed: nothing is multiplied in forward. ``one_pass``: 4-bit weights go to e4m3 in one kernel
    (:func:`frozen_weight_e4m3`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        quant_state: Any,
        bias: torch.Tensor | None,
        columns_out: torch.Tensor,
        columns_in: torch.Tensor,
        keep: bool,
        unread: bool,
        one_pass: bool = False,
    ) -> torch.Tensor:
        w8, w8t = frozen_weight_e4m3(weight, quant_state, x.dtype, columns_out[:, :1], not unread, keep, one_pass)
        in_features, out_features = columns_in.shape[1], columns_out.shape[1]
        ctx.keep, ctx.in_features, ctx.one_pass = keep, in_features, one_pass
        if keep:
            ctx.save_for_backward(columns_in, w8t)
        else:
            ctx.save_for_backward(columns_in, weight)
            ctx.quant_state = quant_state
        shape = (*x.shape[:-1], out_features)
        if w8 is None:
            return x.new_empty(shape)
        x8, x_scale = quantize_rows(x.reshape(-1, in_features))
        out = fp8_matmul(x8, x_scale, w8, columns_out, x.dtype).reshape(shape)
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.keep:
            columns_in, w8t = ctx.saved_tensors
        else:
            columns_in, weight = ctx.saved_tensors
            scale = columns_in[:, :1]
            _, w8t = frozen_weight_e4m3(weight, ctx.quant_state, grad.dtype, scale, False, True, ctx.one_pass)
        g8, g_scale = quantize_rows(grad.reshape(-1, grad.shape[-1]))
        grad_x = fp8_matmul(g8, g_scale, w8t, columns_in, grad.dtype).reshape(*grad.shape[:-1], ctx.in_features)
        return grad_x, None, None, None, None, None, None, None, None


def fits(in_features: int, out_features: int) -> bool:
    """fp8 matmuls need both widths to be multiples of 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


def _probe(device: torch.device) -> str | None:
    """None when a per-row-scaled e4m3 product runs on ``device``, else the error."""
    try:
        a = torch.ones(16, 32, device=device).to(E4M3)
        b = torch.ones(16, 32, device=device).to(E4M3)
        out = fp8_matmul(a, torch.ones(16, 1, device=device), b, torch.ones(1, 16, device=device), torch.bfloat16)
        return None if out.shape == (16, 16) else f"unexpected output shape {tuple(out.shape)}"
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as err:
        return str(err).splitlines()[0][:160]


def unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 base matmuls cannot run on ``device`` (None when they can)."""
    if device.type != "cuda":
        where = "the CPU would only emulate them, slower" if device.type == "cpu" else f"not {device.type}"
        return f"fp8 products need an NVIDIA GPU with fp8 tensor cores; {where}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (
            f"needs fp8 tensor cores (sm89 or newer: RTX 40/50 series, Hopper, Blackwell, GB10); this GPU "
            f"is sm{major}{minor}"
        )
    key = str(device)
    if key not in _PROBED:
        _PROBED[key] = _probe(device)
    problem = _PROBED[key]
    return None if problem is None else f"this torch cannot multiply fp8 with per-row scales here: {problem}"


def scoped(on: bool, reason: str, scope: str, checkpointing: str) -> tuple[bool, str]:
    """(on, reason) once the scope is applied: fp8 only in the recompute needs offloaded checkpointing's recompute."""
    if not on or scope != "recompute":
        return on, reason
    if checkpointing != "offloaded":
        return False, (
            "fp8 in the recompute multiplies in fp8 only in offloaded checkpointing's recompute; with "
            f"{checkpointing} checkpointing every product stays 16-bit"
        )
    return True, reason + "; the forward pass and its loss stay 16-bit (fp8 in the recompute and the input gradients)"


def resolve(
    requested: str,
    device: torch.device,
    frozen: int,
    checkpointing: str = "none",
    four_bit: bool = False,
    experts: bool = False,
) -> tuple[bool, str]:
    """(on, reason) on ``device`` (:func:`resolve_from`)."""
    problem = None if requested == "off" or frozen == 0 else unavailable_reason(device)
    return resolve_from(requested, problem, frozen, checkpointing, four_bit, experts)


def resolve_from(
    requested: str,
    problem: str | None,
    frozen: int,
    checkpointing: str = "none",
    four_bit: bool = False,
    experts: bool = False,
) -> tuple[bool, str]:
    """(on, reason). Automatic only where it was measured within bf16 noise: a dense model with a 4-bit (QLoRA) base
    under offloaded checkpointing, where the automatic scope keeps the forward pass in 16 bits
    (:func:`scope_of`); not for MoE models (``experts``), whose speed with it was not measured. ``requested``: the
    ``fp8_base`` setting (auto, off, recompute, all); ``problem``: :func:`unavailable_reason` of the device."""
    if requested == "off":
        return False, "switched off: frozen weights multiply in the model's 16-bit dtype"
    if frozen == 0:
        return False, "the model has no frozen linear projections in its decoder layers"
    if problem is not None:
        return False, problem
    if requested != "auto":
        return True, "switched on: frozen weights multiply in e4m3 with per-row scales on fp8 tensor cores"
    if not four_bit or experts or checkpointing != "offloaded":
        return False, (
            "automatic: off; on only for a dense model with a 4-bit (QLoRA) base under offloaded checkpointing, where "
            "fp8 products in the recompute and the input gradients measured within bf16 noise (switch on to use fp8 "
            "here)"
        )
    return True, (
        "automatic: frozen 4-bit weights multiply in e4m3 with per-row scales on fp8 tensor cores in the recompute "
        "and the input gradients (H200, Llama-3.1-8B under 8 GiB: 311 against 361 ms a step, 20-step losses as "
        "close to float32 LoRA as bf16's)"
    )


def scope_of(requested: str) -> str:
    """Where fp8 products run: everywhere for ``all``; otherwise (``recompute``, and the automatic choice) only in
    offloaded checkpointing's recompute and the input gradients, the forward pass and its loss in 16 bits."""
    return "all" if requested == "all" else "recompute"
