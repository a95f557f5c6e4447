"""Long runs: host memory does not grow step over step.

A hobbyist's run takes thousands of steps; a few kilobytes kept per step (a loss tensor with its graph, a growing
list of metrics) ends it hours in. The tiny model runs 150 steps with checkpoints and evaluation, and the resident
memory the run reports per step (StepMetrics.memory_bytes is the process RSS on CPU) must be flat over the second
half, after allocator warm-up; on a GPU machine the same test checks the per-step peak of GPU memory
(StepMetrics.memory_bytes is then the true peak, the allocator's peak reserved memory, which a leak grows in its
2 MiB blocks). A second test plants a leak of 256 KiB per step and checks that the same measurement catches it, so
the soak test can fail.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from pathlib import Path

import torch
from hang import HANG_S

from engine.config import RunConfig
from engine.events import RunFinished, StepMetrics
from engine.run import step as step_module
from engine.train import run

TOLERANCE_BYTES_PER_STEP = 32 * 1024


def make_config(model_dir: Path, data: Path, out: Path, steps: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir)},
            "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.1},
            "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1},
            "training": {"max_steps": steps, "warmup_steps": 5, "save_every": 25, "eval_every": 25},
            "output": {"dir": str(out), "name": "soak"},
        }
    )


def rss_slope(model_dir: Path, data: Path, out: Path, steps: int) -> float:
    """Least-squares growth of resident memory, bytes per step, over the second half of a run."""
    events = list(run(make_config(model_dir, data, out, steps)))
    assert isinstance(events[-1], RunFinished), events[-1]
    samples = [(e.step, float(e.memory_bytes)) for e in events if isinstance(e, StepMetrics)][steps // 2 :]
    xs = torch.tensor([s for s, _ in samples], dtype=torch.float64)
    ys = torch.tensor([m for _, m in samples], dtype=torch.float64)
    xs = xs - xs.mean()
    return float((xs * (ys - ys.mean())).sum() / (xs * xs).sum())


def measure_in_fresh_process(model_dir: Path, data: Path, out: Path, steps: int, leak: bool) -> float:
    """Run ``rss_slope`` in a new interpreter: in a long test session, freed-but-resident heap pages would absorb
    new allocations and hide growth from RSS."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_slope_child, model_dir, data, out, steps, leak).result(timeout=HANG_S)


def _slope_child(model_dir: Path, data: Path, out: Path, steps: int, leak: bool) -> float:
    torch.set_num_threads(1)
    if leak:
        kept: list[torch.Tensor] = []
        real = step_module._forward_loss

        def leaky(session, batch, num_items):  # type: ignore[no-untyped-def]
            kept.append(torch.ones(64 * 1024, device=session.device))  # 256 KiB per forward, never released
            return real(session, batch, num_items)

        step_module._forward_loss = leaky  # only in this throwaway child process
    return rss_slope(model_dir, data, out, steps)


def test_host_memory_is_flat_over_a_long_run(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    slope = measure_in_fresh_process(tiny_model_dir, chat_file, tmp_path, steps=150, leak=False)
    assert abs(slope) < TOLERANCE_BYTES_PER_STEP, f"resident memory grows by {slope / 1024:.1f} KiB per step"


def test_the_soak_measurement_catches_a_leak(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    slope = measure_in_fresh_process(tiny_model_dir, chat_file, tmp_path, steps=40, leak=True)
    assert slope > TOLERANCE_BYTES_PER_STEP, f"a 256 KiB/step leak measured as {slope / 1024:.1f} KiB per step"
