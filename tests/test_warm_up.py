"""Warm-up that pays back (engine.speed.warm_up) and what runs leave for the next (engine.speed.reuse): the pure
decision, the decisions store, the compile cache's folders, and the run length a session hands its controller."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import RunConfig, SpeedConfig
from engine.run.methods import method_for
from engine.run.session import Session, start
from engine.speed import SpeedController, fused_kernels, reuse, step_graphs, warm_up
from engine.speed.reuse import DecisionKey, DecisionStore, GraphTrial, Measured
from engine.speed.warm_up import FIGURES, RunLength, WarmUpClock, WarmUpLedger

SMALL = FIGURES[0]
"""The SmolLM2-135M row: 27 s to compile (10 s cached), 6 ms per 1,000 tokens saved; step graphs 2 s, 1.5 ms a layer."""
KEY = DecisionKey("NVIDIA H200", "2.11.0", "0123456789abcdef", 512)


# --- the decision -----------------------------------------------------------------------------------------------

ON = "automatic: norms, rotary, SwiGLU and LoRA paths fused per layer by torch.compile (Triton)"


@pytest.mark.parametrize(
    ("requested", "steps", "measured", "want_on", "want_reason"),
    [
        # a hobbyist's 20-step run: 27 s of compiling saves 20 × 3 ms
        (None, 20, None, False, "automatic: off for a 20-step run: compiling costs about 27 s, saves about 0.1 s"),
        # long enough to pay back 27 s at 3 ms a 512-token micro-batch
        (None, 20_000, None, True, "automatic: on for a 20,000-step run: compiling costs about 27 s, saves about 61 s"),
        # the user's choice wins both ways, whatever the length
        (True, 20, None, True, "switched on"),
        (False, 20_000, None, False, "switched off"),
        # an earlier run measured 2 s with the kernels cached: 2,000 steps now pay back (6.1 s saved)
        (None, 2_000, Measured(compile_s=2.0, compile_runs=2), True, "compiling costs about 2.0 s, saves about 6.1 s"),
        (None, 2_000, None, False, "compiling costs about 27 s, saves about 6.1 s"),
        # measured cold (27 s): the kernels are cached now, and the table's cached share (10 of 27) is the cost
        (None, 5_000, Measured(compile_s=27.0, compile_runs=1), True, "compiling costs about 10 s, saves about 15 s"),
    ],
)
def test_fused_kernels_compile_only_where_it_pays_back(
    requested: bool | None, steps: int, measured: Measured | None, want_on: bool, want_reason: str
) -> None:
    reason = {True: "switched on; fused", False: "switched off: eager"}.get(requested, ON)  # type: ignore[arg-type]
    ledger = WarmUpLedger(RunLength(steps, 1, 512), SMALL, layers=30, measured=measured)
    on, said = ledger.fused_kernels(requested, requested is not False, reason)
    assert on is want_on
    assert want_reason in said


def test_without_a_length_or_a_way_to_run_the_choice_is_as_before() -> None:
    assert WarmUpLedger().fused_kernels(None, True, ON) == (True, ON)
    cpu = "automatic: off on CPU (inductor's CPU compile takes ~15 s per model and gains little)"
    assert WarmUpLedger(RunLength(10**6, 1, 512), SMALL, 30).fused_kernels(None, False, cpu) == (False, cpu)


def test_a_compile_this_run_paid_is_kept_when_the_run_decides_again() -> None:
    ledger = WarmUpLedger(RunLength(20_000, 1, 512), SMALL, 30)
    ledger.tick(compiled=True, graphs_on=False, trial=None)
    ledger.length = RunLength(20, 1, 512)  # say the rest of the run is short now
    on, reason = ledger.fused_kernels(None, True, ON)
    assert on and "compiled already in this run" in reason


def test_the_rule_is_saving_times_micro_batches_against_the_one_off_cost() -> None:
    estimate = warm_up.Estimate(one_off_s=10.0, saving_s=0.1, source="test")
    assert not warm_up.pays_back(estimate, 100) and warm_up.pays_back(estimate, 101)
    length = RunLength(steps=25, micro_batches_per_step=4, row_tokens=512)
    assert length.micro_batches == 100 and length.after(7).steps == 24 and length.after(500).steps == 0
    assert warm_up.figures_for(135_000_000) is SMALL and warm_up.figures_for(8_000_000_000) is FIGURES[-1]


TRYING = "automatic: trying; a replayed micro-batch is timed against an eager one"


@pytest.mark.parametrize(
    ("steps", "measured", "want_on", "want_trial", "want_words"),
    [
        # 20 micro-batches × 1.5 ms × 30 layers = 0.9 s saved against 2 s of captures and trial
        (20, None, False, False, "off for a 20-step run: capturing step graphs costs about 2.0 s, saves about 0.9 s"),
        (500, None, True, True, "trying"),
        # an earlier run measured its captures at 0.3 s: a 20-step run pays them back
        (20, Measured(graphs_s=0.3), True, True, "capturing step graphs costs about 0.3 s, saves about 0.9 s"),
        # its trial's verdict replaces the trial, and its times the estimate (51 ms saved per micro-batch)
        (500, Measured(trials={"eager": GraphTrial(True, 60.0, 9.0)}), True, False,
         "saves about 26 s (as measured in an earlier run of this model); an earlier run of this model measured a "
         "micro-batch at 9 ms replayed against 60 ms eagerly, no trial"),
        (5_000, Measured(trials={"eager": GraphTrial(False, 60.0, 70.0)}), False, False,
         "automatic: off; an earlier run of this model measured a micro-batch at 70 ms replayed against 60 ms eagerly"),
        # a verdict timed against compiled layers does not hold for eager ones
        (20, Measured(trials={"compiled": GraphTrial(True, 60.0, 9.0)}), False, False, "off for a 20-step run"),
    ],
)  # fmt: skip
def test_step_graphs_trial_only_where_it_pays_back_and_skipped_where_a_run_measured_it(
    steps: int, measured: Measured | None, want_on: bool, want_trial: bool, want_words: str
) -> None:
    ledger = WarmUpLedger(RunLength(steps, 1, 512), SMALL, layers=30, measured=measured)
    on, reason, trial = ledger.step_graphs(None, True, TRYING, compiled=False)
    assert (on, trial) == (want_on, want_trial)
    assert want_words in reason


def test_step_graphs_the_user_asks_for_run_whatever_the_length() -> None:
    ledger = WarmUpLedger(RunLength(3, 1, 512), SMALL, 30)
    assert ledger.step_graphs(True, True, "switched on", compiled=True) == (True, "switched on", False)
    assert ledger.step_graphs(False, False, "switched off", compiled=True) == (False, "switched off", False)


# --- measuring a run's warm-up and leaving it for the next ------------------------------------------------------


class FakeClock:
    def __init__(self, gaps: list[float]) -> None:
        self.times = iter([sum(gaps[:i]) for i in range(len(gaps) + 1)])

    def __call__(self) -> float:
        return next(self.times)


def test_a_run_records_its_compile_and_the_trial_and_the_next_run_reads_them(tmp_path: Path) -> None:
    store = DecisionStore.in_folder(tmp_path)
    gaps = [30.0, 0.5, 0.4, *[0.1] * 5]  # compiling, the trial and a capture, then the settled pace
    ledger = WarmUpLedger(RunLength(20, 1, 512), SMALL, 30, store, KEY, clock=WarmUpClock(7, FakeClock(gaps)))
    for i in range(8):
        ledger.tick(compiled=True, graphs_on=True, trial=(True, 60.0, 9.0) if i >= 3 else None)
    got = store.read(KEY)
    assert got is not None and got.compile_runs == 1
    assert got.compile_s == pytest.approx(29.9) and got.graphs_s == pytest.approx(0.7) and got.step_ms == 100.0
    assert got.trials == {"compiled": GraphTrial(True, 60.0, 9.0)}
    # the next run: its compile costs the cached share, and the trial is not run again
    again = WarmUpLedger(RunLength(20_000, 1, 512), SMALL, 30, store, KEY, store.read(KEY))
    assert "compiling costs about 11 s" in again.fused_kernels(None, True, ON)[1]
    on, reason, trial = again.step_graphs(None, True, TRYING, compiled=True)
    assert on and not trial and "no trial" in reason


def test_a_trial_that_ends_after_the_clock_is_written_too(tmp_path: Path) -> None:
    store = DecisionStore.in_folder(tmp_path)
    ledger = WarmUpLedger(RunLength(40, 1, 512), SMALL, 30, store, KEY, clock=WarmUpClock(4, FakeClock([1.0] * 9)))
    for i in range(8):
        ledger.tick(compiled=False, graphs_on=True, trial=(False, 50.0, 55.0) if i == 6 else None)
    got = store.read(KEY)
    assert got is not None and got.trials == {"eager": GraphTrial(False, 50.0, 55.0)} and got.compile_runs == 0


def test_a_run_without_warm_up_writes_nothing(tmp_path: Path) -> None:
    store = DecisionStore.in_folder(tmp_path)
    ledger = WarmUpLedger(RunLength(40, 1, 512), SMALL, 30, store, KEY, clock=WarmUpClock(4, FakeClock([1.0] * 9)))
    for _ in range(8):
        ledger.tick(compiled=False, graphs_on=False, trial=None)
    assert not store.path.exists()


# --- the decisions store ----------------------------------------------------------------------------------------


def test_the_store_round_trips_and_keeps_keys_apart(tmp_path: Path) -> None:
    store = DecisionStore.in_folder(tmp_path / "home")
    record = Measured(compile_s=12.5, compile_runs=2, graphs_s=1.0, step_ms=9.2, trials={"compiled": GraphTrial(
        True, 61.0, 9.2)})  # fmt: skip
    assert store.write(KEY, record)
    got = store.read(KEY)
    assert got is not None and dataclasses.replace(got, updated=0.0) == record and got.updated > 0
    assert store.read(dataclasses.replace(KEY, rows=1024)) is None
    assert store.read(dataclasses.replace(KEY, gpu="NVIDIA GeForce RTX 4090")) is None
    assert [p.name for p in store.path.parent.iterdir()] == [reuse.DECISIONS_FILE]  # no temporary file left


@pytest.mark.parametrize(
    "text", ["", "{not json", "[]", '{"format": 99, "entries": {}}', '{"format": 1, "entries": []}',
             '{"format": 1, "entries": {"NVIDIA H200|2.11.0|0123456789abcdef|512": {"compile_s": "soon"}}}'],
)  # fmt: skip
def test_a_damaged_store_reads_as_empty_and_is_replaced_by_the_next_write(tmp_path: Path, text: str) -> None:
    store = DecisionStore.in_folder(tmp_path)
    store.path.write_text(text)
    assert store.read(KEY) is None
    assert store.write(KEY, Measured(compile_s=3.0, compile_runs=1))
    got = store.read(KEY)
    assert got is not None and got.compile_s == 3.0
    assert json.loads(store.path.read_text())["format"] == reuse.FORMAT


def test_a_missing_store_reads_as_empty_and_a_read_only_one_is_not_written(tmp_path: Path) -> None:
    assert DecisionStore.in_folder(tmp_path / "nowhere").read(KEY) is None
    reader = DecisionStore.in_folder(tmp_path, writable=False)
    assert not reader.write(KEY, Measured(compile_s=1.0)) and not reader.path.exists()


def test_a_folder_that_cannot_be_written_only_means_measuring_again(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not DecisionStore(blocker / "decisions.json").write(KEY, Measured(compile_s=1.0))


def test_the_store_keeps_the_newest_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "MAX_ENTRIES", 2)
    store = DecisionStore.in_folder(tmp_path)
    keys = [dataclasses.replace(KEY, rows=rows) for rows in (256, 512, 1024)]
    for key in keys:
        store.write(key, Measured(step_ms=1.0))
    assert store.read(keys[0]) is None and store.read(keys[1]) is not None and store.read(keys[2]) is not None


def test_keys_bucket_rows_and_fingerprint_the_model(tiny_model_dir: Path) -> None:
    assert [reuse.row_bucket(n) for n in (0, 1, 300, 512, 513)] == [1, 1, 512, 512, 1024]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def adapted(rank: int) -> torch.nn.Module:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return get_peft_model(base, LoraConfig(r=rank, target_modules=["q_proj", "v_proj"]))

    four, again, eight = adapted(4), adapted(4), adapted(8)
    prints = [reuse.model_fingerprint(m.base_model.model, m, torch.float32) for m in (four, again, eight)]
    assert prints[0] == prints[1] != prints[2] and len(prints[0]) == 16


# --- the compile cache ------------------------------------------------------------------------------------------


@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever use_compile_cache sets goes back afterwards."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    yield


def test_the_compile_cache_goes_to_the_data_folder(tmp_path: Path, cache_env: None) -> None:
    folder = reuse.use_compile_cache(tmp_path)
    assert folder == tmp_path / "compile_cache" / "inductor" == Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "compile_cache" / "triton")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    assert cache_dir() == str(folder)


def test_folders_the_user_chose_are_kept(tmp_path: Path, cache_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    assert reuse.use_compile_cache(tmp_path / "home") == tmp_path / "mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "my-triton")
    # inductor writes its temp-folder default into the environment once it ran: that is not the user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert reuse.use_compile_cache(tmp_path / "home") == tmp_path / "home" / "compile_cache" / "inductor"


# --- the controller and the session -----------------------------------------------------------------------------


def test_the_controller_decides_with_the_run_length_it_is_given(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    # a GPU's automatic choices, decided on the CPU (nothing runs, so nothing compiles)
    monkeypatch.setattr(fused_kernels, "automatic", lambda model, device: (True, ON))
    monkeypatch.setattr(step_graphs, "unsupported_reason", lambda model, device: None)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    controller = SpeedController(model, SpeedConfig(), torch.device("cpu"))
    assert controller.state()["fused_kernels"]["on"] and controller.state()["step_graphs"]["on"]  # length unknown
    controller.expect(RunLength(20, 1, 48))
    state = controller.state()
    assert not state["fused_kernels"]["on"] and "off for a 20-step run: compiling" in state["fused_kernels"]["reason"]
    assert not state["step_graphs"]["on"] and not controller.graphs.on
    controller.apply(dataclasses.replace(controller.settings, fused_kernels=True))
    _, asked = fused_kernels.resolve(True, model, controller.device)
    assert controller.state()["fused_kernels"] == {"on": True, "reason": asked}


def drive(generator: Iterator[object]) -> Session:
    while True:
        try:
            next(generator)
        except StopIteration as stop:
            return stop.value


def test_a_session_hands_its_controller_the_run_length_and_the_data_folder(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_env: None
) -> None:
    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    config = RunConfig.from_dict({
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(chat_file), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.0},
        "lora": {"rank": 4},
        "training": {"max_steps": 5, "grad_accum": 2, "device": "cpu"},
    })  # fmt: skip
    session = drive(start(config, tmp_path / "run", False, method_for(config.training.method)))
    longest = max(sum(len(session.data.train[i]) for i in row) for row in session.data.train_rows)
    assert session.speed.warm_up.length == RunLength(steps=5, micro_batches_per_step=2, row_tokens=longest)
    assert session.speed.warm_up.store == DecisionStore(tmp_path / "home" / reuse.DECISIONS_FILE)
    assert session.speed.warm_up.key is not None and session.speed.warm_up.key.gpu == "cpu"
    assert not session.speed.warm_up.records  # nothing on the CPU compiles or captures automatically
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "home" / "compile_cache" / "inductor")
