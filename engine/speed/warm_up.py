"""Warm-up that pays back: automatic switches with a one-off cost turn on only where the run is long enough.

Why: fused kernels compile each layer's regions and step graphs run a trial and capture each row shape before the
fast steps start. On the H200 with SmolLM2-135M and 512-token rows, automatic switches take a step from 158 ms
(every switch off) to 9.2 ms, yet a 21-step automatic run took 40.4 s against 43.8 s for a 210-step run with every
switch off: 35-40 s of compiling, capturing and timing was paid by a run that trains for 0.2 s. Hobbyists iterate
with small datasets, so the automatic choice counts that cost against the run's length.

The rule (:func:`decide`): an automatic switch with a one-off cost is on only where

    saving per micro-batch × micro-batches left in the run  >  one-off seconds

An explicit True/False from the user always wins, and a switch that cannot run stays off whatever the run's
length. Without a known length (a bench, a test) the choice is what it was before this rule.

Costs and savings come from the measurements earlier runs of the same model, row shape, GPU and torch left in the
decisions store (:mod:`engine.speed.reuse`), and otherwise from :data:`FIGURES`, a table by model size built from
H200 records. A compile an earlier run paid is cheaper now: inductor's cache in the user's data folder holds its
kernels. Compiling a second time in a run costs nothing (the compiled code stays in memory), so a switch that has
compiled stays on when the run re-decides later.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.hardware.shapes import ModelShape
from engine.speed.reuse import (
    DecisionKey,
    DecisionStore,
    GraphTrial,
    Measured,
    device_name,
    model_fingerprint,
    row_bucket,
)

__all__ = [
    "FIGURES",
    "Estimate",
    "RunLength",
    "WarmUpClock",
    "WarmUpFigures",
    "WarmUpLedger",
    "compile_estimate",
    "decide",
    "figures_for",
    "graphs_estimate",
    "pays_back",
]


@dataclass(frozen=True)
class RunLength:
    """What is left of a run: optimizer steps, micro-batches per step and the tokens of its longest packed row."""

    steps: int
    micro_batches_per_step: int = 1
    row_tokens: int = 0

    @property
    def micro_batches(self) -> int:
        return self.steps * self.micro_batches_per_step

    def after(self, seen: int) -> RunLength:
        """What is left once ``seen`` micro-batches have run."""
        left = max(0, self.micro_batches - seen)
        return dataclasses.replace(self, steps=math.ceil(left / max(1, self.micro_batches_per_step)))

    def describe(self) -> str:
        return f"{self.steps:,}-step run"


@dataclass(frozen=True)
class WarmUpFigures:
    """One-off seconds and savings of the switches with a warm-up, for models of up to ``up_to_params``
    parameters, on the H200 (inductor compiles on its 16 CPU cores)."""

    up_to_params: float
    measured_on: str
    compile_s: float
    """Fused kernels' first compile, with an empty cache."""
    cached_compile_s: float
    """The same with inductor's cache holding the kernels (tracing and loading them remain)."""
    compile_saving_ms_per_1k_tokens: float
    """What the fused per-token kernels save per micro-batch, per thousand tokens in it."""
    graphs_s: float
    """Step graphs' warm-up: each shape bucket's capture and the trial's extra eager micro-batches."""
    graphs_saving_ms_per_layer: float
    """What replaying a micro-batch from a CUDA graph saves the host per decoder layer, where the host sets the pace."""


FIGURES: tuple[WarmUpFigures, ...] = (
    WarmUpFigures(
        up_to_params=0.5e9,
        measured_on="SmolLM2-135M, 512-token rows",
        compile_s=27.0,
        cached_compile_s=10.0,
        compile_saving_ms_per_1k_tokens=6.0,
        graphs_s=2.0,
        graphs_saving_ms_per_layer=1.5,
    ),
    WarmUpFigures(
        up_to_params=2.5e9,
        measured_on="Qwen3-0.6B and Llama-3.2-1B, 16,384-token rows",
        compile_s=75.0,
        cached_compile_s=28.0,
        compile_saving_ms_per_1k_tokens=14.0,
        graphs_s=3.0,
        graphs_saving_ms_per_layer=1.5,
    ),
    WarmUpFigures(
        up_to_params=math.inf,
        measured_on="Llama-3.1-8B in 4-bit, 4,096-token rows",
        compile_s=70.0,
        cached_compile_s=26.0,
        compile_saving_ms_per_1k_tokens=75.0,
        graphs_s=3.0,
        graphs_saving_ms_per_layer=1.5,
    ),
)
"""Where the figures come from (H200, torch 2.11):

* SmolLM2-135M (30 layers, hidden 576), 512-token rows (issue 37, the design notes' H200 table): automatic steps
  9.2 ms against 158 ms with every switch off; a 21-step automatic run 40.4 s against 43.8 s for a 210-step
  all-off run, whose 210 × 158 ms = 33 s of steps leave about 10 s of loading and saving that both runs pay: about
  30 s of one-off work, counted as 27 s compiling and 2 s for step graphs (one capture per shape bucket, up to 8,
  each about an eager micro-batch plus building the graph: an estimate). A second identical run with inductor's
  cache warm took 49 s against 66 s: 17 s less, so 10 s of the compile remain. The fused kernels' own saving was
  not measured alone (6 ms per 1,000 tokens, 3 ms a 512-token micro-batch, is an estimate); even ten times larger
  it would not pay 27 s back in a 210-step run.
* Qwen3-0.6B / Llama-3.2-1B, one 16,384-token row: the first compiled step took 72-75 s alone and 82-86 s with two
  processes compiling side by side (benchmarks/speed_h200.md, engine/speed/fused_kernels.py); fused kernels alone
  took Qwen3-0.6B from 1,149 to 921 ms a step (228 ms per 16,384 tokens: 14 ms per 1,000). The cached compile is
  not measured at this size: the 135M model's share (10 of 27 s) is assumed.
* Llama-3.1-8B in 4-bit, LoRA r32, a 4,096-token row under offloaded checkpointing: compiling takes 50-90 s
  (engine/run/session.py's warm-up note). With every other switch automatic, a run without fused kernels took
  617 ms a step (benchmarks/qlora_app_path_h200.md's first record, where an estimate of 35 ms per 1,000 tokens
  turned them off for a 400-step run) against 311 ms with them (benchmarks/qlora_train_fp8_h200.md): compiled
  regions also carry the one-pass 4-bit to fp8 casts. 306 ms per 4,096 tokens: 75 ms per 1,000, so compiling pays
  back after about 230 steps. (Fused kernels alone, before fp8: 592 to 449 ms.) Step graphs from 444 to 395 ms
  (benchmarks/history/qlora_step_graphs_h200.md), 49 ms over 32 layers: the 1.5 ms a layer every row uses. The
  cached compile assumes the 135M share again.
"""


def figures_for(params: int) -> WarmUpFigures:
    """The table's row for a model of ``params`` parameters."""
    return next(row for row in FIGURES if params <= row.up_to_params)


@dataclass(frozen=True)
class Estimate:
    """One switch's one-off seconds, its saving per micro-batch, and where both come from."""

    one_off_s: float
    saving_s: float
    source: str


def pays_back(estimate: Estimate, micro_batches: int) -> bool:
    """The rule: on only where what the switch saves over the run's micro-batches exceeds its one-off cost."""
    return estimate.saving_s * micro_batches > estimate.one_off_s


def decide(
    requested: bool | None, on: bool, reason: str, work: str, estimate: Estimate | None, length: RunLength | None
) -> tuple[bool, str]:
    """(on, reason) of a switch with a one-off cost. ``on``/``reason``: its choice without the run's length;
    ``work``: what the one-off cost buys ("compiling"). The user's True/False, a switch that is off anyway and an
    unknown length keep that choice; otherwise it stays on only where it pays back (:func:`pays_back`)."""
    if requested is not None or not on or estimate is None or length is None:
        return on, reason
    saved = estimate.saving_s * length.micro_batches
    words = f"{work} costs about {_seconds(estimate.one_off_s)}, saves about {_seconds(saved)} ({estimate.source})"
    if not pays_back(estimate, length.micro_batches):
        return False, f"automatic: off for a {length.describe()}: {words}"
    return True, f"automatic: on for a {length.describe()}: {words}; {reason.removeprefix('automatic: ')}"


def _seconds(value: float) -> str:
    return f"{value:,.0f} s" if value >= 9.5 else f"{value:.1f} s"


def compile_estimate(figures: WarmUpFigures, row_tokens: int, measured: Measured | None, sunk: bool) -> Estimate:
    """Fused kernels: the compile they cost this run and what they save per micro-batch of ``row_tokens``.

    ``sunk``: this run has compiled them already (switching back costs nothing). A compile an earlier run measured
    is the cost again where it ran on a warm cache; measured cold, this run finds the kernels cached and pays the
    table's cached share of it."""
    saving = figures.compile_saving_ms_per_1k_tokens * row_tokens / 1e6
    if sunk:
        return Estimate(0.0, saving, "compiled already in this run")
    if measured is None or measured.compile_s is None:
        return Estimate(figures.compile_s, saving, f"estimated from {figures.measured_on} on an H200")
    if measured.compile_cached:
        return Estimate(measured.compile_s, saving, "as measured in an earlier run of this model, kernels cached")
    cached = measured.compile_s * figures.cached_compile_s / figures.compile_s
    return Estimate(cached, saving, "an earlier run of this model compiled them; its kernels are cached now")


def graphs_estimate(figures: WarmUpFigures, layers: int, measured: Measured | None, compiled: bool) -> Estimate:
    """Step graphs: their warm-up and what a replay saves per micro-batch, from an earlier run's trial if any."""
    trial = measured.trials.get(trial_state(compiled)) if measured is not None else None
    warm_up = measured.graphs_s if measured is not None and measured.graphs_s is not None else figures.graphs_s
    if trial is not None:
        saving = (trial.eager_ms - trial.replay_ms) / 1e3
        return Estimate(warm_up, saving, "as measured in an earlier run of this model")
    saving = figures.graphs_saving_ms_per_layer * layers / 1e3
    return Estimate(warm_up, saving, f"estimated from {figures.measured_on} on an H200")


def trial_state(compiled: bool) -> str:
    """The decisions store keeps a step-graph verdict per fused-kernel state: it was timed against that eager path."""
    return "compiled" if compiled else "eager"


# --- measuring this run's warm-up -------------------------------------------------------------------------------


@dataclass
class WarmUpClock:
    """Host time from each of the run's first micro-batches' start to the next's: the first one holds the compile,
    the next ones the step-graph trial and captures; the median of the later ones is the settled pace."""

    window: int = 16
    """Micro-batch intervals measured; the clock is done after them."""
    clock: Callable[[], float] = time.perf_counter
    starts: list[float] = field(default_factory=list)

    def tick(self) -> None:
        """A micro-batch starts."""
        if not self.done:
            self.starts.append(self.clock())

    @property
    def done(self) -> bool:
        return len(self.starts) > self.window

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]

    def settled_s(self) -> float:
        gaps = self.gaps()
        return statistics.median(gaps[len(gaps) // 2 :])

    def first_extra_s(self) -> float:
        """What the first micro-batch took beyond a settled one (compiling, when fused kernels were on)."""
        return max(0.0, self.gaps()[0] - self.settled_s())

    def later_extra_s(self) -> float:
        """What the micro-batches after the first took beyond settled ones (the step-graph trial, captures)."""
        later = self.gaps()[1:]
        return max(0.0, sum(later) - self.settled_s() * len(later))


# --- the controller's view --------------------------------------------------------------------------------------


@dataclass
class WarmUpLedger:
    """What the speed controller knows of the run's length and earlier runs' measurements, and what it measures of
    this run's warm-up to leave for the next run. Empty (no length, no store), every choice is as before."""

    length: RunLength | None = None
    figures: WarmUpFigures = FIGURES[0]
    layers: int = 0
    store: DecisionStore | None = None
    key: DecisionKey | None = None
    measured: Measured | None = None
    clock: WarmUpClock = field(default_factory=WarmUpClock)
    seen: int = 0
    compiled_first: bool = False
    """The first micro-batch ran with fused kernels on: the clock's first interval holds their compile."""
    compiled_once: bool = False
    graphs_ran: bool = False
    trial: GraphTrial | None = None
    trial_compiled: bool = False
    written: bool = False
    trial_written: bool = False
    records: bool = True
    """Measurements are left for later runs (GPU runs only: nothing on the CPU compiles or captures automatically)."""

    @classmethod
    def for_run(
        cls, model: torch.nn.Module, hf_model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
        length: RunLength, store: DecisionStore | None,
    ) -> WarmUpLedger:  # fmt: skip
        """The ledger of a run of ``length``, with what ``store`` holds for this model, row shape, GPU and torch."""
        shape = ModelShape.from_config(hf_model.config)
        key = DecisionKey(device_name(device), torch.__version__, model_fingerprint(hf_model, model, dtype),
                          row_bucket(length.row_tokens))  # fmt: skip
        measured = store.read(key) if store is not None else None
        window = max(4, min(WarmUpClock.window, length.micro_batches - 1))
        return cls(length, figures_for(shape.total_params()), shape.num_layers, store, key, measured,
                   WarmUpClock(window=window), records=device.type == "cuda")  # fmt: skip

    def remaining(self) -> RunLength | None:
        return self.length.after(self.seen) if self.length is not None else None

    def fused_kernels(self, requested: bool | None, on: bool, reason: str) -> tuple[bool, str]:
        """The fused-kernel switch's (on, reason) with the run's length counted."""
        length = self.remaining()
        if length is None:
            return on, reason
        estimate = compile_estimate(self.figures, length.row_tokens, self.measured, sunk=self.compiled_once)
        return decide(requested, on, reason, "compiling", estimate, length)

    def step_graphs(self, requested: bool | None, on: bool, reason: str, compiled: bool) -> tuple[bool, str, bool]:
        """(on, reason, trial) for step graphs: a verdict an earlier run stored replaces the trial."""
        length = self.remaining()
        if length is None or requested is not None or not on:
            return on, reason, on and requested is None
        recorded = self.measured.trials.get(trial_state(compiled)) if self.measured is not None else None
        if recorded is not None and not recorded.keep:
            times = f"{recorded.replay_ms:,.0f} ms replayed against {recorded.eager_ms:,.0f} ms eagerly"
            return False, f"automatic: off; an earlier run of this model measured a micro-batch at {times}", False
        estimate = graphs_estimate(self.figures, self.layers, self.measured, compiled)
        on, reason = decide(requested, on, reason, "capturing step graphs", estimate, length)
        if on and recorded is not None:
            times = f"{recorded.replay_ms:,.0f} ms replayed against {recorded.eager_ms:,.0f} ms eagerly"
            reason = f"{reason.split(';')[0]}; an earlier run of this model measured a micro-batch at {times}, no trial"
        return on, reason, on and recorded is None

    def tick(self, compiled: bool, graphs_on: bool, trial: tuple[bool, float, float] | None) -> None:
        """A micro-batch starts, with fused kernels and step graphs as given, and the trial's result if it has one."""
        if self.seen == 0:
            self.compiled_first = compiled
        self.seen += 1
        self.compiled_once = self.compiled_once or compiled
        self.graphs_ran = self.graphs_ran or graphs_on
        self.clock.tick()
        if trial is not None and self.trial is None:
            self.trial, self.trial_compiled = GraphTrial(*trial), compiled
        if self.store is None or self.key is None or not self.records:
            return
        if self.clock.done and not self.written:
            self.written = self._write()
        elif self.written and self.trial is not None and not self.trial_written:
            self._write()  # the trial ended after the clock did

    def _write(self) -> bool:
        """Leave this run's measurements for the next run; True once the warm-up is recorded (or has nothing to
        record: a run with neither fused kernels nor step graphs)."""
        if not (self.compiled_first or self.graphs_ran or self.trial is not None):
            return True
        record = recorded_measurements(self.measured or Measured(), self)
        assert self.store is not None and self.key is not None
        self.store.write(self.key, record)
        self.measured = record
        self.trial_written = self.trial is not None
        return True


def recorded_measurements(before: Measured, ledger: WarmUpLedger) -> Measured:
    """``before`` updated with what ``ledger`` measured in this run (its warm-up once, when its clock is done)."""
    clock = ledger.clock
    trials = dict(before.trials)
    if ledger.trial is not None:
        trials[trial_state(ledger.trial_compiled)] = ledger.trial
    if not clock.done or ledger.written:
        return dataclasses.replace(before, trials=trials)
    return dataclasses.replace(
        before,
        compile_s=round(clock.first_extra_s(), 2) if ledger.compiled_first else before.compile_s,
        compile_runs=before.compile_runs + ledger.compiled_first,
        graphs_s=round(clock.later_extra_s(), 2) if ledger.graphs_ran else before.graphs_s,
        step_ms=round(clock.settled_s() * 1e3, 2),
        trials=trials,
    )
