"""Keeping the best adapter by held-out loss, saying when that loss gets worse, and stopping early when asked.

Tried on a real 135M instruct model (70 chat examples, 30 held out, 30 epochs), the held-out loss bottomed at step
40 (0.787) and rose to 0.985 by step 210, and a run that kept only its final adapter handed the user the worse
model without a word. So every run with held-out data watches its evaluations (:class:`EvalWatch`, a pure
record of the losses): a new lowest loss copies the adapter into ``adapter-best/`` beside the final ``adapter/``
(with ``best.json``: the step and loss it comes from), three rises in a row are reported, and with
``training.early_stop`` N evaluations without a new lowest loss end the run. DPO runs watch the held-out pairs'
loss.

The copy is taken on the host at once (a few MB for a LoRA adapter) and written to disk by one background
thread, atomically like a checkpoint (a temporary folder renamed into place), so training goes on while it is
written; a write error surfaces at the next write or at the end of the run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.adapter import BEST_ADAPTER, BEST_RECORD, best_adapter
from engine.run import checkpoint as ckpt
from engine.run.folder import adapter_contents, write_adapter

RISES_TO_WARN = 3
"""Evaluations in a row whose held-out loss rose before the run says so."""


@dataclass(frozen=True)
class EvalVerdict:
    """What one evaluation means for the run."""

    improved: bool
    """A new lowest held-out loss: its adapter becomes the best."""
    rises: int
    """Evaluations in a row (this one included) whose loss was above the one before."""
    warn: bool
    """The rises just reached :data:`RISES_TO_WARN` (said once a streak)."""
    stop: bool
    """``early_stop`` evaluations in a row brought no new lowest loss."""


@dataclass
class EvalWatch:
    """The run's held-out losses so far: the lowest and where, rises in a row, evaluations since the lowest."""

    early_stop: int = 0
    """Stop after this many evaluations without a new lowest loss (0: never)."""
    best_step: int | None = None
    best_loss: float | None = None
    previous: float | None = None
    rises: int = 0
    since_best: int = 0
    last_step: int | None = None
    stopping: bool = False
    """The last evaluation asked the run to stop early."""

    def observe(self, step: int, loss: float) -> EvalVerdict:
        self.last_step = step
        rose = self.previous is not None and loss > self.previous
        self.rises = self.rises + 1 if rose else 0
        self.previous = loss
        improved = self.best_loss is None or loss < self.best_loss
        if improved:
            self.best_step, self.best_loss, self.since_best = step, loss, 0
        else:
            self.since_best += 1
        stop = self.early_stop > 0 and self.since_best >= self.early_stop
        self.stopping = stop
        return EvalVerdict(improved, self.rises, self.rises == RISES_TO_WARN, stop)

    @classmethod
    def resumed(cls, early_stop: int, losses: Iterable[tuple[int, float]], run_dir: Path) -> EvalWatch:
        """The watch of a resumed run: its earlier evaluations replayed, the kept best adapter's loss as the best
        (it may come from steps past the checkpoint, which the resumed run trains again)."""
        watch = cls(early_stop)
        for step, loss in losses:
            watch.observe(step, loss)
        kept = best_adapter(run_dir)
        if kept is None or kept.eval_loss is None:
            return watch
        if watch.best_loss is None or kept.eval_loss < watch.best_loss:
            watch.best_step, watch.best_loss = kept.step, kept.eval_loss
        return watch

    def rising_message(self, step: int, loss: float) -> str:
        return (
            f"the held-out loss has risen {self.rises} evaluations in a row, to {loss:.4f} at step {step} "
            f"(lowest {self.best_loss:.4f} at step {self.best_step}): the model is fitting the training examples "
            f"at the cost of new ones; the best adapter so far (step {self.best_step}) is kept in {BEST_ADAPTER}/"
            + ("" if self.early_stop else ", and --early-stop N would end such a run after N evaluations")
        )

    def stop_message(self) -> str:
        return (
            f"stopping early: {self.since_best} evaluations without a lower held-out loss than {self.best_loss:.4f} "
            f"(step {self.best_step}); the best adapter is in {BEST_ADAPTER}/"
        )


def host_copy(model: Any, gathered: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The trainable weights as they are now, on the host, safe to write while training changes the model."""
    if gathered is not None:  # FSDP2 gathered them whole into new host tensors already
        return gathered
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


class BestAdapterWriter:
    """Writes ``adapter-best/`` in a background thread, one write at a time (a newer best waits for the older)."""

    def __init__(self, run_dir: Path) -> None:
        self.folder = run_dir / BEST_ADAPTER
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tunedeck-best-adapter")
        self._pending: Future[Path] | None = None

    def write(self, model: Any, tokenizer: Any, weights: dict[str, torch.Tensor], step: int, loss: float) -> None:
        """Queue the adapter ``weights`` (a :func:`host_copy`) from ``step`` with held-out ``loss``. What is saved
        is taken now, as the final adapter is (:func:`engine.run.folder.adapter_contents`: every LoRA layer, behind a
        speed stand-in or not); only the writing waits in the thread."""
        self.wait()
        contents = adapter_contents(model, weights)
        record = json.dumps({"step": step, "eval_loss": loss}) + "\n"
        self._pending = self._pool.submit(write_adapter, self.folder, contents, tokenizer, {BEST_RECORD: record})

    def wait(self) -> None:
        """Until the queued write is on disk; raises the error that stopped it (a full disk, say)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except OSError as err:
            raise ckpt.write_error(err, "best adapter", self.folder) from err

    def shutdown(self) -> None:
        """Let a queued write finish (it stays whole either way) and end the thread; errors were raised by
        :meth:`wait` already, or the run is ending on another error."""
        self._pool.shutdown(wait=True)
