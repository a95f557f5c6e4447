"""Preference pairs saved from the chat: one file per base model, crash-safe appends, undo, the export that DPO
training reads, and "train on my preferences" as a real DPO run from a run's adapter."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_S
from test_chat import train_tiny_run

from engine.data.files import load_examples
from engine.data.preferences import (
    MIN_PAIRS,
    PreferenceError,
    PreferenceStore,
    last_exchange,
    model_key,
    saved_models,
)
from engine.events import Notice, RunFailed, RunFinished, StepMetrics
from engine.model.adapter import run_adapter
from engine.run.preference_run import DPO_EPOCHS, train_on_preferences
from engine.train import run


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder of this test's own."""
    folder = tmp_path / "home"
    monkeypatch.setenv("TUNEDECK_HOME", str(folder))
    return folder


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("preferences"))


def ask(number: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"say {number}"}]


def save(store: PreferenceStore, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        store.add(ask(i), f"number {i}", f"the fox {i}", chosen_by="tuned", rejected_by="base", run="abc123")


def test_pairs_are_kept_per_base_model_in_the_data_folder(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "models" / "model"
    folder.mkdir(parents=True)
    typed_differently = PreferenceStore(str(folder / ".." / "model"))
    assert typed_differently.path == PreferenceStore(str(folder)).path  # one folder, one file
    assert typed_differently.path.parent == home / "preferences" and typed_differently.path.suffix == ".jsonl"
    other = tmp_path / "elsewhere" / "model"
    other.mkdir(parents=True)
    assert model_key(str(other)) != model_key(str(folder))  # same folder name, another model
    assert model_key("ollama:smollm2:135m").startswith("ollama-smollm2-135m-")
    assert model_key("Qwen/Qwen2.5-0.5B").startswith("Qwen2.5-0.5B-")


def test_a_pair_is_saved_with_where_its_answers_came_from(home: Path) -> None:
    store = PreferenceStore("demo")
    assert store.count() == 0 and store.pairs() == []
    pair = store.add(ask(1), "number 1", "the fox", chosen_by="base", rejected_by="tuned", run="r1", edited=True)
    (line,) = store.path.read_text(encoding="utf-8").splitlines()
    record = json.loads(line)
    assert record["prompt"] == ask(1) and record["chosen"] == "number 1" and record["rejected"] == "the fox"
    assert record["chosen_by"] == "base" and record["rejected_by"] == "tuned" and record["run"] == "r1"
    assert record["edited"] is True and record["model"] == "demo" and record["created"] > 0
    assert store.pairs() == [pair]
    save(PreferenceStore("demo"), 2)  # the same base model: the same file
    assert PreferenceStore("demo").count() == 3
    assert saved_models() == [("demo", 3)]


@pytest.mark.parametrize(
    ("prompt", "chosen", "rejected", "words"),
    [
        (ask(1), "same", "same", "nothing to prefer"),
        (ask(1), "  ", "the fox", "chosen answer is empty"),
        (ask(1), "number", "", "rejected answer is empty"),
        ([], "number", "fox", "needs the prompt"),
        ([{"role": "robot", "content": "hi"}], "number", "fox", "unknown role"),
    ],
)
def test_a_pair_training_would_refuse_is_refused_when_saved(
    prompt: list[dict[str, str]], chosen: str, rejected: str, words: str
) -> None:
    store = PreferenceStore("demo")
    with pytest.raises(PreferenceError, match=words):
        store.add(prompt, chosen, rejected, chosen_by="tuned", rejected_by="base")
    assert not store.path.exists()


def test_a_save_cut_off_loses_only_its_own_line(home: Path) -> None:
    store = PreferenceStore("demo")
    save(store, 2)
    whole = store.path.read_bytes()
    store.path.write_bytes(whole + whole.splitlines(keepends=True)[0][:25])  # a crash mid-write: a torn last line
    stored = store.read()
    assert len(stored.pairs) == 2
    assert stored.skipped == [f"{store.path.name}, line 3: skipped, cut off by an interrupted save"]
    save(store, 1, start=7)  # the next pair starts on a line of its own
    stored = store.read()
    assert [p.chosen for p in stored.pairs] == ["number 0", "number 1", "number 7"]
    assert len(stored.skipped) == 1 and "line 3: skipped, not a saved pair" in stored.skipped[0]


def test_a_damaged_line_is_named_and_the_others_read(home: Path) -> None:
    store = PreferenceStore("demo")
    save(store, 1)
    with store.path.open("a", encoding="utf-8") as handle:
        handle.write('{"prompt": "not messages"}\n')
    save(store, 1, start=1)
    stored = store.read()
    assert [p.chosen for p in stored.pairs] == ["number 0", "number 1"]
    assert len(stored.skipped) == 1 and "line 2" in stored.skipped[0] and "missing" in stored.skipped[0]


def test_undo_removes_exactly_one_pair(home: Path) -> None:
    store = PreferenceStore("demo")
    save(store, 3)
    middle = store.pairs()[1]
    assert store.remove(middle.id)
    assert [p.chosen for p in store.pairs()] == ["number 0", "number 2"]
    assert not store.remove(middle.id)  # already gone
    assert not list(store.folder.glob(".tmp-*"))


def test_the_export_is_dpo_data_the_engine_reads(home: Path, tmp_path: Path) -> None:
    store = PreferenceStore("demo")
    with pytest.raises(PreferenceError, match="nothing to export"):
        store.export(tmp_path / "none.jsonl")
    save(store, 3)
    conversation = [*ask(9), {"role": "assistant", "content": "number 9"}, *ask(10)]
    store.add(conversation, "number 10", "the fox", chosen_by="tuned, sample 1", rejected_by="tuned, sample 2")
    target = tmp_path / "out" / "pairs.jsonl"
    assert store.export(target) == 4
    rows = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert set(rows[0]) == {"prompt", "chosen", "rejected"}  # TRL's columns, no metadata
    examples, fmt = load_examples(target)
    assert fmt == "preference" and len(examples) == 4 and all(pair.is_chat for pair in examples)  # type: ignore[union-attr]
    last = examples[-1]
    assert [m.content for m in last.prompt] == ["say 9", "number 9", "say 10"]  # type: ignore[union-attr]
    assert [(m.role, m.content) for m in last.chosen] == [("assistant", "number 10")]  # type: ignore[union-attr]


def test_two_chat_histories_make_a_pair_only_when_they_answer_the_same_talk() -> None:
    said = [*ask(1), {"role": "assistant", "content": "number 1"}]
    assert last_exchange(said, [*ask(1), {"role": "assistant", "content": "fox"}]) == (ask(1), "number 1", "fox")
    went_on = [*said, *ask(2)]
    assert (
        last_exchange(
            [*went_on, {"role": "assistant", "content": "a"}], [*went_on, {"role": "assistant", "content": "b"}]
        )[0]
        == went_on
    )
    for first, second, words in [
        ([], [], "ask for two answers"),
        (said, ask(1), "only one answer"),  # the second reply was stopped before it began
        (said, [*ask(3), {"role": "assistant", "content": "x"}], "different conversations"),
    ]:
        with pytest.raises(PreferenceError, match=words):
            last_exchange(first, second)


def test_training_needs_a_few_pairs_and_says_how_many_more(home: Path, run_folder: Path) -> None:
    store = PreferenceStore.for_run(run_folder)
    save(store, 1)
    with pytest.raises(PreferenceError, match=rf"1 preferences saved for .*at least {MIN_PAIRS} .*\(3 more\)"):
        train_on_preferences(run_folder)


def test_train_on_my_preferences_is_a_dpo_run_from_the_runs_adapter(
    home: Path, run_folder: Path, tiny_model_dir: Path
) -> None:
    store = PreferenceStore.for_run(run_folder)
    assert store.path == PreferenceStore(str(tiny_model_dir)).path  # the run's base model
    save(store, 6)
    config = train_on_preferences(run_folder)
    best = run_adapter(run_folder, "best")
    assert best is not None and best.which == "best"
    assert config.training.method == "dpo" and config.model.adapter == str(best.folder)
    assert config.model.name == str(tiny_model_dir) and config.data.format == "preference"
    assert config.data.eval_fraction == 0.0 and config.training.epochs == DPO_EPOCHS
    assert config.dpo.beta == 0.1 and config.dpo.loss == "sigmoid"  # DPO's defaults
    assert Path(config.output.dir) == run_folder.parent
    snapshot = Path(config.data.path)
    frozen = snapshot.read_bytes()
    save(store, 1, start=50)  # a pair saved later is not in what this run reads
    assert snapshot.read_bytes() == frozen and len(frozen.splitlines()) == 6
    last = train_on_preferences(run_folder, "last")
    assert last.model.adapter == str(run_folder / "adapter") and last.data.path != config.data.path
    assert snapshot.name == "preferences.jsonl"  # the run's default name ends in -preferences

    events: list[Any] = list(run(config))
    assert not [e for e in events if isinstance(e, RunFailed)]
    assert any(isinstance(e, Notice) and "starting from the adapter" in e.message for e in events)
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert steps and all(s.rewards_chosen is not None for s in steps)
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    saved = json.loads((Path(finished.run_dir) / "config.json").read_text(encoding="utf-8"))
    assert saved["training"]["method"] == "dpo" and saved["model"]["adapter"] == str(best.folder)
    assert (Path(finished.run_dir) / "adapter" / "adapter_model.safetensors").exists()


def first_step(config: Any) -> StepMetrics:
    events = list(run(config))
    assert not [e for e in events if isinstance(e, RunFailed)], events
    return next(e for e in events if isinstance(e, StepMetrics))


def test_training_on_my_preferences_starts_level_with_the_fine_tune(home: Path, run_folder: Path) -> None:
    """Pairs of "the fine-tune's answer over the base's" are not won before the run has learned anything: the
    reference is the fine-tune the run starts from. Against the base model (``--dpo-reference base``) they are."""
    save(PreferenceStore.for_run(run_folder), 6)
    config = train_on_preferences(run_folder)
    assert config.dpo.reference == "start"
    one_step = dataclasses.replace(config, training=dataclasses.replace(config.training, max_steps=1))
    step = first_step(one_step)
    assert step.rewards_chosen == pytest.approx(0.0, abs=1e-6) and step.rewards_rejected == pytest.approx(0.0, abs=1e-6)
    assert step.reward_margin == pytest.approx(0.0, abs=1e-6) and step.loss == pytest.approx(math.log(2), abs=1e-6)
    against_base = first_step(dataclasses.replace(one_step, dpo=dataclasses.replace(config.dpo, reference="base")))
    assert against_base.reward_margin is not None and abs(against_base.reward_margin) > 1e-2
    assert abs(against_base.loss - math.log(2)) > 1e-3


def tunedeck(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TUNEDECK_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "preferences", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )


def test_the_command_lists_exports_and_removes_pairs(home: Path, run_folder: Path, tmp_path: Path) -> None:
    assert "no preferences saved yet" in tunedeck(home, "list").stdout
    store = PreferenceStore.for_run(run_folder)
    save(store, 2)
    listed = tunedeck(home, "list")
    assert listed.returncode == 0 and f"2  {store.model}" in listed.stdout
    pairs = tunedeck(home, "list", "--run", str(run_folder))
    first = store.pairs()[0]
    assert pairs.returncode == 0 and f"{first.id}" in pairs.stdout and "tuned over base" in pairs.stdout
    target = tmp_path / "mine.jsonl"
    exported = tunedeck(home, "export", "--model", str(store.model), "--to", str(target))
    assert exported.returncode == 0 and "2 pairs" in exported.stdout
    assert load_examples(target)[1] == "preference"
    assert tunedeck(home, "remove", "--run", str(run_folder), first.id).returncode == 0
    assert store.count() == 1
    refused = tunedeck(home, "train", str(run_folder))
    assert refused.returncode == 1 and "3 more" in refused.stderr and "Traceback" not in refused.stderr
