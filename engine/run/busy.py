"""How long a rank worked on a step, apart from the time it waited for the others.

Under DDP every rank ends a step at the same moment (the gradient all-reduce pairs them up), so the step's wall time
cannot tell a slow computer from a fast one. What differs is when each rank hands over its gradients: DDP calls its
communication hook for a bucket as soon as that bucket's gradients are computed here, and the backward pass returns
only once every bucket is reduced across ranks. :class:`GradientClock` is that hook (DDP's own all-reduce, plus one
clock read per bucket): the time from its last call to the end of the backward pass is this rank's wait for the
network and the slower ranks, and a step's *busy time* is the time to the end of the backward pass less that wait.

On a GPU the host runs ahead of the device, so the hook also records a CUDA event: the wait is then the device's time
from that event to the end of the backward pass (read after the step's loss has come to the host, which waits for
the gradient all-reduce anyway), and the busy time is measured on the device's clock, not the host's.

Under FSDP2 no such hook exists and the busy time includes the waits, so the ranks' figures come out alike there.
"""

import os
import time
from typing import Any

import torch
import torch.distributed as dist

# no postponed annotations here: DDP checks the hook's annotations against the real classes

SLOW_ENV = "TUNEDECK_SLOW_RANK"
"""Tests only: ``"RANK:SECONDS"`` makes that rank hand over each gradient bucket SECONDS late, as a slower computer
would."""


class GradientClock:
    """DDP's communication hook that notes when this rank's gradients were ready; see the module docstring."""

    def __init__(self) -> None:
        self.last_ready: float | None = None
        self.ready_event: torch.cuda.Event | None = None
        self.delay_s = 0.0

    def arm(self, rank: int) -> None:
        """Read the test delay (:data:`SLOW_ENV`) meant for ``rank``, if any."""
        spec = os.environ.get(SLOW_ENV, "")
        target, _, seconds = spec.partition(":")
        self.delay_s = float(seconds) if spec and target == str(rank) else 0.0

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.delay_s:
            time.sleep(self.delay_s)
        self.last_ready = time.perf_counter()
        if bucket.buffer().is_cuda:
            self.ready_event = torch.cuda.Event(enable_timing=True)
            self.ready_event.record()
        return allreduce_hook(state, bucket)

    def busy_s(self, started: float) -> float:
        """Seconds since ``started`` (a ``perf_counter`` reading at the step's start, taken once the step's loss is on
        the host) less the wait after this rank's last gradient bucket was handed over (none known: nothing taken
        off); the step's readings are then cleared."""
        elapsed = time.perf_counter() - started
        waited = self._waited_s(started)
        self.last_ready, self.ready_event = None, None
        return max(0.0, elapsed - waited)

    def _waited_s(self, started: float) -> float:
        ready = self.last_ready
        if ready is None or ready < started:
            return 0.0
        if self.ready_event is None:
            return time.perf_counter() - ready
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()  # at once: the stream already finished the step's backward to give its loss
        return float(self.ready_event.elapsed_time(end)) / 1000
