"""Printing a run for a terminal: a progress bar with loss, tokens/s and ETA, or one JSON object per event."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from engine.config import RunConfig
from engine.distributed.node_figures import nodes_line
from engine.events import (
    BestAdapterKept,
    CheckpointSaved,
    EvalMetrics,
    EvalRising,
    Event,
    NodeFigures,
    Notice,
    OomRecovered,
    RunFailed,
    RunFinished,
    RunPaused,
    RunStarted,
    SpeedChanged,
    SpeedRestored,
    StepMetrics,
    StepSkipped,
)
from engine.run.control import RunControl
from engine.run.estimate import format_duration

NODE_LINE_EVERY = 10
"""A run over several computers prints its per-node line at its first step and every this many steps."""


class ProgressPrinter:
    """Turns events into a tqdm bar and short lines; remembers how the run ended."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr  # read now: a test or a host may swap stderr
        self.bar: Any = None
        self.finished: RunFinished | None = None
        self.failed: RunFailed | None = None
        self.device = ""
        self.peak_memory: int | None = None
        """The largest step peak seen (StepMetrics.memory_bytes: reserved GPU memory, or RSS on the CPU)."""
        self.driver_memory: int | None = None
        self.estimated_s: float | None = None
        """The training time the run expected before its first step (RunStarted), set beside the time it took."""
        self.node_lines = 0

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream)

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self._started(event)
        elif isinstance(event, StepMetrics):
            self._stepped(event)
        elif isinstance(event, EvalMetrics):
            self.write(eval_line(event))
        elif isinstance(event, NodeFigures):
            self._nodes(event)
        elif isinstance(event, (CheckpointSaved, BestAdapterKept)):
            pass  # frequent; the final folders are reported at the end
        elif isinstance(event, EvalRising):
            self.write(f"warning: step {event.step}: {event.message}")
        elif isinstance(event, Notice):
            self.write(f"note: {event.message}")
        elif isinstance(event, OomRecovered):
            self.write(f"out of memory at step {event.step}: {event.message}")
        elif isinstance(event, SpeedRestored):
            self.write(f"step {event.step}: {event.message}")
        elif isinstance(event, StepSkipped):
            self.write(
                f"step {event.step}: loss or gradient not finite, update skipped "
                f"({event.consecutive} in a row, {event.total_skipped} in all)"
            )
        elif isinstance(event, SpeedChanged):
            self.write(describe_speed(event, on_cpu=self.device == "cpu"))
        elif isinstance(event, RunPaused):
            self.write(f"paused at step {event.step}")
        elif isinstance(event, RunFinished):
            self._close()
            self.finished = event
        elif isinstance(event, RunFailed):
            self._close()
            self.failed = event

    def _stepped(self, event: StepMetrics) -> None:
        self.peak_memory = max(self.peak_memory or 0, event.memory_bytes)
        if event.driver_memory_bytes is not None:
            self.driver_memory = max(self.driver_memory or 0, event.driver_memory_bytes)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {event.loss:.4f}{step_figures(event)}", refresh=False)
            self.bar.update(event.step - self.bar.n)

    def _nodes(self, event: NodeFigures) -> None:
        if self.node_lines == 0 or event.step % NODE_LINE_EVERY == 0:
            self.write(nodes_line(event))
            self.node_lines += 1

    def _started(self, event: RunStarted) -> None:
        from tqdm import tqdm

        self.device = event.device

        self.write(
            f"run folder: {event.run_dir}\n"
            f"device {event.device} ({event.dtype}); {event.train_examples} training examples in "
            f"{event.train_rows} packed rows ({event.packing_efficiency:.0%} full), {event.eval_examples} held out; "
            f"training {event.trainable_params:,} of {event.total_params:,} parameters"
        )
        self.estimated_s = event.estimated_s
        if event.estimated_s is not None:
            self.write(f"training takes about {format_duration(event.estimated_s)} ({event.estimate_basis})")
        self.bar = tqdm(
            total=event.total_steps, initial=event.start_step, unit="step", file=self.stream, dynamic_ncols=True
        )

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self) -> str:
        if self.failed:
            hint = f"\n  hint: {self.failed.hint}" if self.failed.hint else ""
            return f"error: {self.failed.message}{hint}"
        done = self.finished
        if done is None:
            return "the run ended without a result"
        status = "stopped" if done.cancelled else "stopped early" if done.stopped_early else "finished"
        loss = f"{done.final_loss:.4f}" if done.final_loss is not None else "n/a"
        evaluation = f", eval loss {done.eval_loss:.4f}" if done.eval_loss is not None else ""
        memory = f"\n{peak_memory_line(self.device, self.peak_memory, self.driver_memory)}" if self.peak_memory else ""
        expected = ""
        if self.estimated_s is not None and not done.cancelled:
            expected = f" (expected {format_duration(self.estimated_s)} before the start)"
        return (
            f"{status} at step {done.step} in {done.wall_time_s:.1f} s{expected}: train loss {loss}{evaluation}"
            f"{memory}\n"
            f"adapter: {done.adapter_dir}{best_adapter_line(done)}"
        )


def eval_line(event: EvalMetrics) -> str:
    """An evaluation as one line: the held-out loss, or a GRPO run's mean reward of greedy held-out answers."""
    if event.reward_mean is not None:
        return f"step {event.step}: held-out mean reward {event.reward_mean:.3f} (greedy answers)"
    accuracy = "" if event.reward_accuracy is None else f", reward accuracy {event.reward_accuracy:.0%}"
    return f"step {event.step}: eval loss {event.loss:.4f}{accuracy}"


def step_figures(event: StepMetrics) -> str:
    """What the progress bar shows after a step's loss: DPO's margin; GRPO's rewards, answer length, KL, clip
    fraction and the sampling and update speeds; then tokens per second."""
    if event.reward_mean is None:
        margin = "" if event.reward_margin is None else f"  margin {event.reward_margin:.3f}"
        return f"{margin}  {event.tokens_per_s:,.0f} tok/s"
    parts = [f"reward {event.reward_mean:.3f}±{event.reward_std or 0:.3f}"]
    parts += [f"{name} {value:.2f}" for name, value in (event.reward_means or {}).items()]
    parts.append(f"len {event.completion_length or 0:.0f}")
    if event.kl is not None:
        parts.append(f"kl {event.kl:.4f}")
    parts.append(f"clip {event.clip_fraction or 0:.0%}")
    if event.generation_tokens_per_s is not None:
        parts.append(f"sample {event.generation_tokens_per_s:,.0f} tok/s")
    parts.append(f"update {event.update_tokens_per_s or 0:,.0f} tok/s")
    return "  " + "  ".join(parts)


def best_adapter_line(done: RunFinished) -> str:
    """Where the best adapter is and where it comes from ("" for a run without held-out data)."""
    if done.best_adapter_dir is None or done.best_step is None or done.best_eval_loss is None:
        return ""
    return (
        f"\nbest adapter (lowest eval loss, {done.best_eval_loss:.4f} at step {done.best_step}; what chat and "
        f"export use unless given --last): {done.best_adapter_dir}"
    )


def peak_memory_line(device: str, peak: int, driver: int | None) -> str:
    """The run's memory peak in plain words: reserved GPU memory (step graphs' pool and the allocator's cache
    included), and the driver's figure where it gave one; on the CPU, the process's resident memory."""
    if not device.startswith("cuda"):
        return f"peak process memory (resident): {peak / 2**30:.2f} GiB"
    seen = f" ({driver / 2**30:.2f} GiB as the driver sees it, CUDA context included)" if driver else ""
    return f"peak GPU memory (reserved): {peak / 2**30:.2f} GiB{seen}"


def describe_speed(event: SpeedChanged, on_cpu: bool = False) -> str:
    """One line per optimization: what is in force and why. On a CPU only what applies there: the switches that
    are on and the modes chosen (most switches need an NVIDIA GPU, and a list of them all off says nothing)."""
    lines = [f"speed settings from step {event.step}:"]
    hidden = 0
    for name, state in event.state.items():
        choice = state.get("backend") or state.get("mode") or ("on" if state.get("on") else "off")
        if "on" in state and not state["on"]:
            choice = "off"
        if on_cpu and choice in ("off", "stock"):
            hidden += 1
            continue
        lines.append(f"  {name.replace('_', ' ')}: {choice} ({state.get('reason', '')})")
    if hidden:
        lines.append(f"  {hidden} more are off: they need an NVIDIA GPU or do not apply to this run (--json lists why)")
    return "\n".join(lines)


def open_registry() -> Any:
    """The user's run registry, or None (with a note) when it cannot be opened: a run never depends on it."""
    from engine.run.registry import Registry, RegistryError

    try:
        return Registry()
    except (RegistryError, OSError) as err:
        print(f"note: this run is not recorded in the run history: {err}", file=sys.stderr)
        return None


def run_events(
    config: RunConfig, control: RunControl, *, resume: str | Path | None, json_lines: bool, record: bool = True
) -> ProgressPrinter:
    """Drive a run to its end, printing as it goes (and recording it in the run history); returns the printer."""
    from engine.run.recorder import recorded
    from engine.train import run

    printer = ProgressPrinter()
    events = run(config, control=control, resume=resume)
    if record and config.training.node_rank == 0:  # another node's run lives in node 0's folder and history
        events = recorded(events, open_registry())
    for event in events:
        if json_lines:
            print(json.dumps(event.to_dict()), flush=True)
            if isinstance(event, RunFinished):
                printer.finished = event
            elif isinstance(event, RunFailed):
                printer.failed = event
        else:
            printer.handle(event)
    return printer


def run_with_progress(config: RunConfig, control: RunControl, *, resume: str | None, json_lines: bool) -> int:
    printer = run_events(config, control, resume=resume, json_lines=json_lines)
    if not json_lines:
        print(printer.summary(), file=sys.stderr if printer.failed else sys.stdout)
    if printer.finished is not None and not printer.failed and config.training.node_rank == 0:  # node 0 has the run
        print_report(Path(printer.finished.run_dir), json_lines)
    return 1 if printer.failed else 0


def print_report(run_dir: Path, json_lines: bool) -> None:
    """Measure the run's before/after report, write it beside the run and print it (with ``json_lines``, whose
    stream holds only the run's events, it is only written: ``tunedeck report RUN --json`` prints it). A failure
    to measure never fails the run that trained: it is reported, with the command to try again."""
    from engine.run.report import report_after_run

    outcome = report_after_run(run_dir)
    if outcome.report is None:
        print(f"note: {outcome.note}", file=sys.stderr)
    elif not json_lines:
        print(f"\n{outcome.report.markdown()}(written to {outcome.path})")
    warning = outcome.report.knowledge_warning() if outcome.report is not None else None
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
