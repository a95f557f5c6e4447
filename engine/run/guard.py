"""Keeping a run alive through out-of-memory steps and non-finite losses.

Out of memory: a CUDA OOM inside a step leaves the optimizer untouched (gradients are zeroed, nothing was
stepped), so the step can simply be taken again with less. The first remedy is a smaller token budget per
micro-batch: every packed row of the step is split, in order, into consecutive pieces of at most that many tokens
and the pieces are accumulated into the same optimizer step. Documents never attend across each other and the
loss is a sum over trained tokens divided by the step's trained-token count, so the update is the same as with
the full rows (to float rounding) and the data order does not change; only the kernels get smaller. A document
cannot be split, so the budget never drops below the longest document of the failing step; past that, activation
checkpointing is switched to offloaded, then the MLPs (and the other per-token modules of layers that are not
compiled) run over chunks of the sequence in the recompute, and when that fails too the run stops with a message
saying so. Chunks are what let one long document train: a single 8,192-token document of Llama-3.1-8B in 4-bit
ran out of an 8 GiB cap on the H200 with whole-row MLPs, and trained in chunks at a 6.83 GiB peak, 1.4 s a step.

Non-finite values: a NaN or inf loss (or gradient norm) would poison the adapter and the AdamW moments for the
rest of the run. Such a step is skipped (gradients zeroed, no optimizer or scheduler step) and counted; after
``training.max_bad_steps`` in a row the run stops, leaving the last checkpoint as it was.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import TuneDeckError

TOKENS_PER_BATCH = "tokens_per_batch"
OFFLOADED_CHECKPOINTING = "offloaded_checkpointing"
CHUNKED_MLP = "chunked_mlp"


class TrainingHalted(TuneDeckError):
    """Training cannot go on (out of memory at the smallest setting, or a loss that stays non-finite)."""


def is_out_of_memory(err: BaseException) -> bool:
    """True for CUDA's OutOfMemoryError and for the RuntimeErrors older kernels raise with the same meaning."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def release_memory(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Drop the failed step's gradients and activations and hand cached blocks back to the driver."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def split_row(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Split one packed row (its documents' lengths, in order) into consecutive groups of at most ``budget`` tokens.

    Returns positions into ``lengths``; a document longer than the budget forms a group of its own.
    """
    groups: list[list[int]] = []
    used = budget + 1
    for position, length in enumerate(lengths):
        if used + length > budget:
            groups.append([])
            used = 0
        groups[-1].append(position)
        used += length
    return groups


@dataclass(frozen=True)
class OomAction:
    """What to lower after an out-of-memory step."""

    kind: str
    tokens_per_batch: int

    def describe(self, previous_budget: int) -> str:
        if self.kind == TOKENS_PER_BATCH:
            return (
                f"out of GPU memory: retrying the step with at most {self.tokens_per_batch} tokens per micro-batch "
                f"(was {previous_budget}); the same data is trained in smaller pieces"
            )
        if self.kind == CHUNKED_MLP:
            return (
                "out of GPU memory: retrying the step with the MLPs run over chunks of the sequence in the recompute "
                "(slower, less memory)"
            )
        return "out of GPU memory: retrying the step with offloaded activation checkpointing (slower, less memory)"


def next_oom_action(
    budget: int, longest_document: int, offload_tried: bool, chunks_tried: bool = True
) -> OomAction | None:
    """The next, smaller setting after an OOM; None when nothing is left to lower. ``chunks_tried``: the
    per-token modules already run in chunks (or did, and it was not enough)."""
    if budget > longest_document:
        return OomAction(TOKENS_PER_BATCH, max(longest_document, budget // 2))
    if not offload_tried:
        return OomAction(OFFLOADED_CHECKPOINTING, budget)
    if not chunks_tried:
        return OomAction(CHUNKED_MLP, budget)
    return None


def out_of_memory_error(step: int, budget: int) -> TrainingHalted:
    return TrainingHalted(
        f"out of GPU memory at step {step}, even with {budget} tokens per micro-batch, offloaded checkpointing and "
        "the MLPs in chunks",
        hint="use QLoRA, a lower data.max_seq_len or LoRA rank, or close other programs that use the GPU; "
        "the run can be resumed from its last checkpoint",
    )


@dataclass
class NonFiniteCounter:
    """Counts skipped steps; tells when too many came in a row."""

    limit: int
    in_a_row: int = 0
    total: int = 0
    first_bad_step: int = 0

    def good(self) -> None:
        self.in_a_row = 0

    def bad(self, step: int) -> None:
        if self.in_a_row == 0:
            self.first_bad_step = step
        self.in_a_row += 1
        self.total += 1

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def error(self, last_checkpoint: str | None) -> TrainingHalted:
        kept = f"the last checkpoint ({last_checkpoint}) is intact" if last_checkpoint else "no checkpoint was written"
        return TrainingHalted(
            f"the loss or gradient was not finite (NaN/inf) for {self.in_a_row} steps in a row "
            f"from step {self.first_bad_step}; training stopped and {kept}",
            hint="lower the learning rate, use bfloat16 or float32 instead of float16, or look for broken rows "
            "in the data; then resume the run",
        )


def is_finite(value: float) -> bool:
    return math.isfinite(value)
