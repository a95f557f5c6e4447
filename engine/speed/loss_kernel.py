"""One Triton kernel for a chunk's cross-entropy loss and softmax gradient: two reads of the logits, one write.

Why: the fused loss (:mod:`engine.speed.fused_loss`) turns each chunk of 16-bit logits into its loss sum and its
gradient ``(softmax - one_hot) · scale``. Compiled by inductor, that function is one reduction kernel that reads
the chunk three times (max, sum of exponentials, gradient), and its launch configuration is tuned once, for the
shapes of the first call. Inside a QLoRA step on the H200 (Llama-3.1-8B, 512 x 128,256 logits per chunk) the
compiled kernel took 2.1 ms a chunk, 17 ms of a 327 ms step, against 0.22 ms for the same call alone: the
configuration chosen at the first call does not suit the chunks that follow. This kernel has one fixed layout,
one program per row: an online max-and-sum pass gives the row's log-sum-exp, a second pass writes the gradient.
On the H200 it takes 0.12 ms a chunk alone (the compiled kernel 0.22 ms, the eager reference 1.25 ms) and 0.12 ms
inside the step (1 ms of the step for the 8 chunks of a 4,096-token row, from 17 ms).

Numerics follow the reference (:func:`engine.speed.fused_loss.softmax_cross_entropy_grad`): the logits are read
as float32, the gradient is computed in float32 and rounded once to the logits' dtype; ignored rows add nothing
to the loss and get a zero gradient.

Triton compiles for NVIDIA GPUs; on the CPU the same kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

__all__ = ["BLOCK", "NUM_WARPS", "available", "softmax_cross_entropy_grad"]

BLOCK = 4096
"""Vocabulary entries a program reads per step of its loops."""
NUM_WARPS = 16
"""Warps per program (one program per row): 0.116 ms for 512 x 128,256 bf16 logits on the H200, 0.119 with 8."""


def available(device: torch.device) -> bool:
    """True where the kernel compiles: a CUDA device and an importable Triton."""
    if device.type != "cuda":
        return False
    try:
        _kernel()
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use so that importing this module needs no Triton."""
    import triton
    import triton.language as tl

    # a Triton kernel: its parameters are pointers and scalars that Triton types at launch, and Triton is untyped
    @triton.jit  # type: ignore[untyped-decorator]
    def cross_entropy_grad(  # type: ignore[no-untyped-def]
        logits,
        labels,
        grad,
        loss,
        vocab,
        logits_stride,
        grad_stride,
        scale,
        ignore_index: tl.constexpr,
        block: tl.constexpr,
    ):  # pragma: no cover - runs on the GPU or under Triton's interpreter
        row = tl.program_id(0).to(tl.int64)
        row_logits = logits + row * logits_stride
        label = tl.load(labels + row)
        running_max = tl.full([block], -1e30, tl.float32)
        running_sum = tl.zeros([block], tl.float32)
        for start in range(0, vocab, block):
            cols = start + tl.arange(0, block)
            x = tl.load(row_logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, x)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(x - new_max)
            running_max = new_max
        row_max = tl.max(running_max, 0)
        lse = row_max + tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), 0))
        valid = label != ignore_index
        target_col = tl.where(valid, label, 0)
        target = tl.load(row_logits + target_col).to(tl.float32)
        tl.store(loss + row, tl.where(valid, lse - target, 0.0))
        weight = tl.where(valid, scale, 0.0)
        row_grad = grad + row * grad_stride
        for start in range(0, vocab, block):
            cols = start + tl.arange(0, block)
            x = tl.load(row_logits + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - (cols == target_col).to(tl.float32)) * weight
            tl.store(row_grad + cols, g.to(grad.dtype.element_ty), mask=cols < vocab)

    return cross_entropy_grad


def softmax_cross_entropy_grad(
    logits: torch.Tensor, labels: torch.Tensor, scale: float, *, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 loss sum, d(scale · loss sum)/d logits in the logits' dtype) of one (rows, vocab) chunk.

    Rows whose label is ``ignore_index`` count for nothing.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        shapes = f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(f"expected (rows, vocab) logits and (rows,) labels, got {shapes}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        on_its_device = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
        with on_its_device:  # Triton launches on the current device, which need not be the tensors'
            _kernel()[(rows,)](
                logits,
                labels.to(torch.int64).contiguous(),
                grad,
                loss,
                vocab,
                logits.stride(0),
                grad.stride(0),
                float(scale),
                ignore_index=ignore_index,
                block=BLOCK,
                num_warps=NUM_WARPS,
            )
    return loss.sum(), grad
