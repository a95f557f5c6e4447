"""Keeping a run alive through out-of-memory steps and non-finite losses.

Out of memory: a CUDA OOM inside a step leaves the optimizer untouched (gradients are zeroed, nothing was
stepped), so the step can simply be taken again. The first try releases what the failed attempt left cached and
runs the same settings once more: a shortage is often a moment's fragmentation, not a setting that cannot fit.
Only when that fails too is anything lowered, and only one thing at a time, the least costly first (resident
layers, then the step graphs' pool, then the micro-batch size, offloaded checkpointing, chunked MLPs). Nothing is
lowered for good: :class:`Recovery` tries the faster setting again after ``CLIMB_AFTER`` good steps when the
steps since left a memory margin, and waits twice as long after each climb that ran short again. The remedy for
the micro-batch size is a smaller token budget per
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
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.config import SpeedConfig
from engine.errors import TuneDeckError

TOKENS_PER_BATCH = "tokens_per_batch"
OFFLOADED_CHECKPOINTING = "offloaded_checkpointing"
CHUNKED_MLP = "chunked_mlp"
RESIDENT_LAYERS = "resident_layers"
STEP_GRAPHS = "step_graphs"
RETRY = "retry"
"""The first answer to a shortage: release cached memory and run the same settings again."""

CLIMB_AFTER = 20
"""Good steps after a setting was lowered before the faster one is tried again (doubled after each failed climb)."""
MAX_CLIMBS = 3
"""Climbs per setting that may run short again before it stays lowered for the rest of the run."""
CLIMB_MARGIN = 0.10
"""Share of the usable GPU memory the steps since the shortage must have left free for a climb."""


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


def fallback_settings(kind: str, settings: SpeedConfig) -> SpeedConfig:
    """The speed settings a fallback asks for; the speed controller decides again from them with the one
    checkpointing decision (engine.hardware.checkpoint_choice), so a GPU that cannot offload gets standard recompute
    and says why. Fallbacks that are not speed settings (the micro-batch size) leave them as they are."""
    if kind == OFFLOADED_CHECKPOINTING:
        return replace(settings, checkpointing="offloaded")
    if kind == CHUNKED_MLP:
        return replace(settings, chunked_mlp=True)
    return settings


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


@dataclass(frozen=True)
class Lowered:
    """One setting an out-of-memory step lowered: what, at which step, and the value to go back to."""

    kind: str
    step: int
    previous: Any = None

    def describe(self) -> str:
        what = {
            RESIDENT_LAYERS: "resident layers",
            STEP_GRAPHS: "step graphs",
            TOKENS_PER_BATCH: f"micro-batches of {self.previous} tokens",
            OFFLOADED_CHECKPOINTING: "the checkpointing it had before",
            CHUNKED_MLP: "whole-row MLPs",
        }.get(self.kind, self.kind)
        return f"memory has had room since step {self.step}: trying {what} again"


@dataclass
class Recovery:
    """What out-of-memory steps took away, and when to try it again (pure bookkeeping; the step applies it).

    A step's first shortage is retried with the same settings (:meth:`retry_first`). Each lowering is pushed
    (:meth:`lowered_now`); after ``climb_after`` good steps whose peak left ``margin`` of the usable memory free,
    :meth:`due` hands back the most recent one to undo. A setting that runs short again after a climb waits twice as
    long, and after ``max_climbs`` such failures it stays lowered.
    """

    climb_after: int = CLIMB_AFTER
    max_climbs: int = MAX_CLIMBS
    margin: float = CLIMB_MARGIN
    lowered: list[Lowered] = field(default_factory=list)
    good_steps: int = 0
    highest_peak: int = 0
    """The highest true peak of the good steps since the last change."""
    failed_climbs: dict[str, int] = field(default_factory=dict)
    climbed: set[str] = field(default_factory=set)
    """Settings tried again and not yet proven by ``climb_after`` good steps."""
    retried_step: int | None = None

    def retry_first(self, step: int) -> bool:
        """True the first time ``step`` ran short: release memory and run the same settings again."""
        if self.retried_step == step:
            return False
        self.retried_step = step
        return True

    def lowered_now(self, kind: str, step: int, previous: Any = None) -> None:
        if kind in self.climbed:  # the faster setting ran short again after a climb
            self.climbed.discard(kind)
            self.failed_climbs[kind] = self.failed_climbs.get(kind, 0) + 1
        self.lowered.append(Lowered(kind, step, previous))
        self._restart()

    def good_step(self, peak_bytes: int) -> None:
        self.good_steps += 1
        self.highest_peak = max(self.highest_peak, peak_bytes)
        if self.good_steps >= self.climb_after:
            self.climbed.clear()  # a climb that lasted this long has proven itself

    def wait_for(self, kind: str) -> int | None:
        """Good steps ``kind`` waits before a climb; None once it has run short after ``max_climbs`` climbs."""
        failures = self.failed_climbs.get(kind, 0)
        return None if failures >= self.max_climbs else self.climb_after * 2**failures

    def due(self, usable_bytes: int | None) -> Lowered | None:
        """The setting to try again now (the most recent lowering), or None."""
        if not self.lowered:
            return None
        last = self.lowered[-1]
        wait = self.wait_for(last.kind)
        if wait is None or self.good_steps < wait:
            return None
        if usable_bytes is not None and self.highest_peak > (1.0 - self.margin) * usable_bytes:
            return None
        return last

    def climbed_back(self, lowered: Lowered) -> None:
        self.lowered.remove(lowered)
        self.climbed.add(lowered.kind)
        self._restart()

    def forget(self, kinds: set[str]) -> None:
        """The user set these switches themselves: what they asked for replaces any lowering of them."""
        self.lowered = [entry for entry in self.lowered if entry.kind not in kinds]

    def _restart(self) -> None:
        self.good_steps = 0
        self.highest_peak = 0
