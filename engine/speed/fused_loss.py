"""Fused linear cross-entropy: the causal-LM loss from the last hidden states, never holding the full logits.

Why: transformers computes ``logits = lm_head(hidden)`` for every token, upcasts them to float32 and lets
cross-entropy keep its own float32 softmax for the backward. That is about 12 bytes per token per vocabulary
entry (16-bit logits, their float32 copy, the float32 gradient): at 16k tokens × 152k vocabulary (Qwen3-0.6B)
about 30 GB, far more than the model and its activations. Here the tokens go through the head in chunks; each
chunk's logits give its log-sum-exp, its share of the loss sum and, in the same pass, its gradients with respect
to the hidden states (and the head weight when that trains), after which the chunk's logits are dropped. Only
the gradients (tokens × hidden, and vocab × hidden when the head trains) are kept for the backward, which just
scales them by the incoming gradient. Positions whose label is ignored never reach the head at all.

Numerics follow the stock path: each chunk's logits are computed in the model's dtype, then upcast to float32
for the log-sum-exp and softmax, and the float32 gradient is cast back to the model's dtype before the matmuls
that carry it to the hidden states, as autograd does through ``logits.float()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from engine.speed import loss_kernel

__all__ = [
    "IGNORE_INDEX",
    "LinearCrossEntropy",
    "choose_chunk_size",
    "chunk_kernel",
    "fused_causal_lm_loss",
    "linear_cross_entropy",
    "linear_cross_entropy_sum",
    "unsupported_reason",
]

IGNORE_INDEX = -100
CHUNK_LOGIT_BYTES = 256 * 2**20
"""Float32 bytes one chunk's logits may take; its softmax gradient takes as much again, its 16-bit logits half."""
MIN_CHUNK_TOKENS = 16


def choose_chunk_size(num_tokens: int, vocab_size: int, budget_bytes: int = CHUNK_LOGIT_BYTES) -> int:
    """Tokens per chunk: as many as keep one chunk's float32 logits within ``budget_bytes``, in multiples of 16.

    A large chunk keeps the head's matmul efficient; the budget (a few hundred MB of working set) keeps it
    small against the model next to the full logits it replaces (30 GB at 16k × 152k).
    """
    fit = max(MIN_CHUNK_TOKENS, budget_bytes // (4 * max(1, vocab_size)) // MIN_CHUNK_TOKENS * MIN_CHUNK_TOKENS)
    return max(1, min(num_tokens, fit))


def _loss_sum(
    logits32: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, log-sum-exp per row, which rows count, labels with ignored rows at 0) of float32 logits."""
    lse = torch.logsumexp(logits32, dim=-1)
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    target = logits32.gather(1, safe[:, None]).squeeze(1)
    return torch.where(valid, lse - target, 0.0).sum(), lse, valid, safe


def softmax_cross_entropy_grad(
    logits: torch.Tensor, labels: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 loss sum, d(scale · loss sum)/d logits in the logits' dtype) of one chunk: the reference path.

    Eager and frugal: one float32 copy of the logits, turned into the gradient in place.
    """
    logits32 = logits.float()
    loss_sum, lse, valid, safe = _loss_sum(logits32, labels)
    # softmax - one_hot, zero on ignored rows, times the scale, written over the float32 copy
    grad = logits32.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], torch.full_like(lse, -1.0)[:, None])
    grad.mul_((valid.to(grad.dtype) * scale)[:, None])
    return loss_sum, grad.to(logits.dtype)


def softmax_cross_entropy_grad_pointwise(
    logits: torch.Tensor, labels: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function written as one reduction and one element-wise pass, for ``torch.compile``.

    Compiled (:func:`compiled_softmax_cross_entropy_grad`), the log-sum-exp reads the 16-bit logits once and the
    gradient is a single kernel that reads them again and writes the 16-bit gradient: no float32 copy of the
    chunk ever exists. On the H200 the eager path's seven float32 passes took 39 of a 244 ms Llama-3.2-1B step.
    GPUs use the hand-written Triton kernel instead (:mod:`engine.speed.loss_kernel`); this one serves elsewhere.
    """
    logits32 = logits.float()
    loss_sum, lse, valid, safe = _loss_sum(logits32, labels)
    one_hot = torch.arange(logits.shape[1], device=logits.device)[None, :] == safe[:, None]
    weight = (valid.to(torch.float32) * scale)[:, None]
    grad = (torch.exp(logits32 - lse[:, None]) - one_hot.to(torch.float32)) * weight
    return loss_sum, grad.to(logits.dtype)


@functools.cache
def compiled_softmax_cross_entropy_grad() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`softmax_cross_entropy_grad_pointwise` compiled once per process (dynamic in the chunk length)."""
    return torch.compile(softmax_cross_entropy_grad_pointwise, dynamic=True)


def chunk_kernel(device: torch.device, compiled: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The function that turns a chunk's logits into (loss sum, gradient) on ``device``.

    ``compiled`` (the fused-kernels switch) picks the Triton kernel of :mod:`engine.speed.loss_kernel` on an
    NVIDIA GPU and the inductor-compiled function elsewhere; off, the eager reference.
    """
    if not compiled:
        return softmax_cross_entropy_grad
    if loss_kernel.available(device):
        return functools.partial(loss_kernel.softmax_cross_entropy_grad, ignore_index=IGNORE_INDEX)
    return compiled_softmax_cross_entropy_grad()


def _chunk_loss_and_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    scale: float,
    need_grad: bool,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 loss sum, d(scale · loss sum)/d logits in the model dtype or None) for one chunk of tokens."""
    logits = F.linear(hidden, weight, bias)
    if not need_grad:
        return _loss_sum(logits.float(), labels)[0], None
    return chunk_kernel(logits.device, compiled)(logits, labels, scale)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    chunk_size: int | None = None,
    weight_grad: bool = False,
    input_grad: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The pure core: (float32 loss sum, grad hidden, grad weight, grad bias) of ``scale · Σ CE(hidden Wᵀ + b)``.

    ``hidden`` is (N, H), ``weight`` (V, H), ``labels`` (N,) with ``IGNORE_INDEX`` for positions that do not
    count. Gradients are of the *scaled* sum; grad hidden comes in the hidden states' dtype, grad weight and
    grad bias are accumulated and returned in float32. ``compiled`` runs each chunk's softmax gradient as
    one fused kernel (:func:`chunk_kernel`) instead of the eager reference.
    """
    n = hidden.shape[0]
    chunk = chunk_size or choose_chunk_size(n, weight.shape[0])
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if input_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
    grad_bias = None
    if weight_grad and bias is not None:
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    for start in range(0, n, chunk):
        h = hidden[start : start + chunk]
        need_grad = input_grad or weight_grad
        loss_sum, grad_logits = _chunk_loss_and_grad(
            h, weight, bias, labels[start : start + chunk], scale, need_grad, compiled
        )
        total += loss_sum
        if grad_logits is None:
            continue
        if grad_hidden is not None:
            torch.matmul(grad_logits, weight, out=grad_hidden[start : start + chunk])
        if grad_weight is not None:
            grad_weight.addmm_(grad_logits.t().float(), h.float())
        if grad_bias is not None:
            grad_bias += grad_logits.float().sum(0)
        del grad_logits
    return total, grad_hidden, grad_weight, grad_bias


class LinearCrossEntropy(torch.autograd.Function):
    """``Σ CE(hidden Wᵀ + b, labels) / divisor`` whose forward already computes the gradients it will need.

    The forward runs :func:`linear_cross_entropy_sum` and saves only grad hidden (and grad weight / bias when
    they require grad); the backward scales them by the incoming gradient. Under ``torch.no_grad`` no gradient
    is computed at all. The saved gradients are those of the plain sum and the backward applies
    ``grad_output / divisor`` in float32: a float16 run's loss scale (65536, above float16's largest value) and
    the 1/num_items factor never meet a 16-bit tensor on their own, so nothing overflows or flushes to zero
    that the stock path would keep.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        divisor: float | torch.Tensor,
        chunk_size: int | None,
        compiled: bool = False,
    ) -> torch.Tensor:
        needs = ctx.needs_input_grad
        total, grad_hidden, grad_weight, grad_bias = linear_cross_entropy_sum(
            hidden,
            weight,
            labels,
            bias=bias,
            scale=1.0,
            chunk_size=chunk_size,
            weight_grad=bool(needs[1] or (bias is not None and needs[2])),
            input_grad=bool(needs[0]),
            compiled=compiled,
        )
        ctx.grads = (grad_hidden, grad_weight if needs[1] else None, grad_bias if needs[2] else None)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.divisor = divisor
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        factor = grad_output.float() / ctx.divisor
        grads = []
        for grad, dtype in zip(ctx.grads, ctx.dtypes, strict=True):
            grads.append(None if grad is None else (grad.float() * factor).to(dtype))
        ctx.grads = None
        return (*grads, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_items: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    positions: torch.Tensor | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Causal-LM loss from (…, T, H) hidden states and (…, T) unshifted labels, as transformers computes it.

    Labels are shifted the way ``ForCausalLMLoss`` does (position t predicts label t+1, the last position
    predicts nothing); the result is the float32 loss sum divided by ``num_items``, or the mean over counted
    positions when it is None. Only positions with a label reach the head. ``positions`` are those flat
    positions when the caller already knows them (the packer computes them on the host): then nothing here waits
    for the GPU. Without them they are found on the device, which costs one host sync to count them.
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    keep = (shifted != IGNORE_INDEX).nonzero().squeeze(1) if positions is None else positions.to(flat.device)
    divisor = _divisor(num_items, keep)
    targets = shifted.index_select(0, keep)
    # torch leaves Function.apply unannotated
    loss: torch.Tensor = LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat.index_select(0, keep), weight, bias, targets, divisor, chunk_size, compiled
    )
    return loss


def _divisor(num_items: int | torch.Tensor | None, keep: torch.Tensor) -> float | torch.Tensor:
    """The loss divisor: a float, or a device tensor as it came (read in a CUDA graph, it changes per replay)."""
    if isinstance(num_items, torch.Tensor) and num_items.device == keep.device:
        return num_items.float()
    return float(num_items) if num_items is not None else float(keep.numel())


def _plain_linear(module: Any) -> bool:
    """True for a head whose whole forward is ``F.linear(x, weight, bias)`` with a float weight."""
    if type(module) is not torch.nn.Linear:  # peft LoRA layers, quantized linears and others run their own forward
        return False
    return module.weight.is_floating_point()


def unsupported_reason(hf_model: Any) -> str | None:
    """Why the fused loss cannot replace this model's own head and loss, or None when it can."""
    config = hf_model.config.get_text_config()
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if head is None or not hasattr(hf_model, "get_decoder"):
        return f"{type(hf_model).__name__} has no separate decoder and output embedding"
    if not _plain_linear(head):
        return f"the output head is a {type(head).__name__} (LoRA or quantized): its own forward is needed"
    if getattr(config, "final_logit_softcapping", None):
        return "final logit soft-capping is applied after the head"
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0) or getattr(config, "logits_scaling", 1.0) != 1.0:
        return "the logits are rescaled after the head"
    if getattr(config, "output_router_logits", False):
        return "the MoE router's auxiliary loss is added to the loss"
    if getattr(hf_model, "loss_type", "ForCausalLM") not in (None, "ForCausalLM"):
        return f"the model's loss is {hf_model.loss_type}, not plain causal-LM cross-entropy"
    return None


def fused_causal_lm_loss(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    num_items: int | torch.Tensor | None,
    chunk_size: int | None = None,
    positions: torch.Tensor | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """The loss of ``model(**inputs, labels=labels, num_items_in_batch=num_items).loss`` without full logits.

    Runs the decoder (LoRA layers included: they live inside it) without the head, then the fused loss
    against the output embedding. Callers check :func:`unsupported_reason` first; ``chunk_size`` defaults to
    :func:`choose_chunk_size`; ``positions`` (``PackedBatch.loss_positions``) make the step free of host syncs;
    ``compiled`` computes each chunk's softmax gradient with one fused kernel (the fused-kernels switch).
    """
    from engine.speed.fused_kernels import transformers_model

    hf_model = transformers_model(model)
    head = hf_model.get_output_embeddings()
    outputs = hf_model.get_decoder()(**inputs, num_items_in_batch=num_items)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    labels = labels.to(hidden.device)
    return linear_cross_entropy(
        hidden,
        head.weight,
        labels,
        bias=head.bias,
        num_items=num_items,
        chunk_size=chunk_size,
        positions=positions,
        compiled=compiled,
    )
