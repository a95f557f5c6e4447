"""Reading a step's loss and gradient norm one step late, so that the GPU never waits for the host between steps.

Why: a training run reports every step's loss and gradient norm, and skips the update of a step whose loss or
gradient is not finite. Read at once, each value makes the host wait until the GPU has finished the step's
backward pass; only then does it queue the update and prepare the next step's rows, and all that while the GPU has
nothing to do. Here the step is queued whole instead: the gradient is clipped on the GPU, the skip is decided
there (the fused AdamW takes a ``found_inf`` flag and leaves weights, moments and step counts as they were when it
is set), and the three values travel to pinned host memory behind the update. The host reads them after it has
queued the next step, by which time the GPU has long finished them.

What changes for the run: nothing in what is learned. A skipped step is known one step later, so the step queued
meanwhile runs with the learning rate one schedule notch further on than it would have, and the schedule is then
put back by one notch. A step's time is measured on the GPU, from the start of its work to the end of its update.

``training.step_readout``: ``auto`` (late where the optimizer can skip on the GPU: the fused AdamW, one process, no
float16 loss scaling), ``late`` or ``immediate``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

__all__ = ["InFlight", "Readback", "began_event", "resolve", "rewind_schedule", "send", "update_on_device"]


def resolve(choice: str, optimizer: torch.optim.Optimizer, distributed: bool, scaled: bool) -> tuple[bool, str]:
    """(late, reason) for ``choice`` with this run's optimizer and processes."""
    if choice == "immediate":
        return False, "step readout: every step before its update, as asked"
    blocker = _blocker(optimizer, distributed, scaled)
    if blocker is not None:
        return False, f"step readout: every step before its update ({blocker})"
    how = "as asked" if choice == "late" else "automatic"
    return True, f"step readout: one step late, {how} (the GPU skips non-finite steps itself)"


def _blocker(optimizer: torch.optim.Optimizer, distributed: bool, scaled: bool) -> str | None:
    if distributed:
        return "several processes sum their losses on the host"
    if scaled:
        return "float16 loss scaling checks the gradients on the host"
    if not optimizer.defaults.get("fused"):
        return "the foreach AdamW cannot skip a non-finite step on the device"
    return None


def update_on_device(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], loss: torch.Tensor, max_norm: float
) -> torch.Tensor:
    """Clip the gradients and update, unless the loss or the gradient norm is not finite, without the host reading
    anything; returns ``(loss, gradient norm, skipped)`` as one float32 tensor on the device."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)
    skipped = torch.logical_not(torch.isfinite(loss) & torch.isfinite(norm)).float()
    optimizer.found_inf = skipped  # type: ignore[attr-defined]  # read by the fused AdamW's step
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
    return torch.stack([loss.float(), norm.float(), skipped])


def rewind_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Put the learning-rate schedule back by one notch (a step turned out skipped after its successor was queued)."""
    scheduler.last_epoch -= 2
    scheduler.step()


@dataclass
class Readback:
    """A step's values on their way to the host, and the GPU events that time the step."""

    values: torch.Tensor
    """(loss, gradient norm, skipped) in host memory once ``copied`` has passed."""
    copied: torch.cuda.Event | None
    began: torch.cuda.Event | None
    started: float

    def read(self) -> tuple[float, float, bool, float]:
        """(loss, gradient norm, skipped, seconds the step took); waits for the GPU only if it is still on it."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.copied is None or self.began is None:
            seconds = time.perf_counter() - self.started
        else:
            seconds = self.began.elapsed_time(self.copied) / 1e3
        loss, norm, skipped = self.values.tolist()
        return loss, norm, bool(skipped), seconds


@dataclass
class InFlight:
    """A queued step: its update is on its way through the GPU, its values on their way to the host."""

    readback: Readback
    learning_rate: float
    tokens: int
    trained_tokens: int
    epoch: float
    memory_bytes: int


def began_event(device: torch.device) -> torch.cuda.Event | None:
    """Marks the start of a step's GPU work (None off the GPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))  # the run's GPU, which need not be the current one
    return event


def send(values: torch.Tensor, began: torch.cuda.Event | None, started: float) -> Readback:
    """Start the copy of ``values`` to the host behind the work queued so far."""
    if values.device.type != "cuda":
        return Readback(values.detach().clone(), None, None, started)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(values.device)
    with torch.cuda.stream(stream):
        host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event(enable_timing=True)
    copied.record(stream)
    return Readback(host, copied, began, started)
