"""How long a rank worked on a step, apart from the time it waited for the others.

Under DDP every rank ends a step at the same moment (the gradient all-reduce pairs them up), so the step's wall time
cannot tell a slow computer from a fast one. What differs is when each rank hands over its gradients: DDP calls its
communication hook for a bucket as soon as that bucket's gradients are computed here, and the backward pass returns
only once every bucket is reduced across ranks. :class:`GradientClock` is that hook (DDP's own all-reduce, plus one
clock read per bucket): the time from its last call to the end of the backward pass is this rank's wait for the
network and the slower ranks, and a step's *busy time* is the time to the end of the backward pass less that wait.

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
        return allreduce_hook(state, bucket)

    def busy_s(self, started: float) -> float:
        """Seconds since ``started`` (a ``perf_counter`` reading at the step's start) less the wait after this rank's
        last gradient bucket was handed over (none known: no wait taken off)."""
        now = time.perf_counter()
        ready = self.last_ready
        waited = now - ready if ready is not None and ready >= started else 0.0
        return max(0.0, now - started - waited)
