"""A CPU run's pace before its first step: one training pass of a row as long as the run's, timed on this machine.

The planner's figure (engine.hardware.row_lengths.cpu_step_seconds) rests on a fixed rate a core; CPUs differ by
more than that figure can know (their vector units, memory, how many cores a laptop keeps busy), so before a CPU
run says how long it takes, it times one forward and backward pass of a ``tokens``-long row of its own model, after
an untimed one that carries the one-off costs (kernel choice, first allocations). The passes leave no gradient
behind and draw from a forked random state, so training goes on exactly as without them.
"""

from __future__ import annotations

import time

import torch

MEASURE_UP_TO_S = 6.0
"""A row the planner expects to take longer than this is not timed (two passes would delay the start too long);
the planner's figure stands."""


def training_pass_seconds(model: torch.nn.Module, tokens: int, vocab: int) -> float:
    """Seconds of one forward and backward pass of a ``tokens``-token row of random ids through ``model``, timed
    after an untimed pass."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(vocab, (1, max(tokens, 2)), generator=generator).to(device)
    seconds = 0.0
    with torch.random.fork_rng(devices=[]):
        for _ in range(2):
            started = time.perf_counter()
            output = model(input_ids=ids, labels=ids, use_cache=False)
            output.loss.backward()
            seconds = time.perf_counter() - started
    for parameter in model.parameters():
        parameter.grad = None
    return seconds
