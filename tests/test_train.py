"""End-to-end runs of the engine on a tiny model: the files a user gets, resume, stop, pause and QLoRA."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from helpers import write_jsonl

from engine.config import RunConfig
from engine.events import CheckpointSaved, RunFailed, RunFinished, RunPaused, RunResumed, RunStarted, StepMetrics
from engine.run.control import RunControl
from engine.train import run


def make_config(model_dir: Path, data: Path, out: Path, **training: object) -> RunConfig:
    raw = {
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.1},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1},
        "training": {"max_steps": 6, "learning_rate": 5e-3, "warmup_steps": 1, "save_every": 2, "eval_every": 3},
        "output": {"dir": str(out), "name": "run"},
    }
    raw["training"].update(training)
    return RunConfig.from_dict(raw)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def assert_same_curve(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def finish(events) -> list:
    collected = list(events)
    failed = [e for e in collected if isinstance(e, RunFailed)]
    assert not failed, failed
    return collected


def test_run_writes_everything_a_user_keeps(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    events = finish(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    started = events[0] if isinstance(events[0], RunStarted) else next(e for e in events if isinstance(e, RunStarted))
    assert started.total_steps == 6 and started.trainable_params < started.total_params
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s.loss > 0 and s.tokens > 0 and s.tokens_per_s > 0 and s.memory_bytes > 0 for s in steps)
    finished = events[-1]
    assert isinstance(finished, RunFinished) and not finished.cancelled and finished.eval_loss is not None
    run_dir = Path(finished.run_dir)
    assert RunConfig.load(run_dir / "config.json").training.max_steps == 6
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert [json.loads(x)["step"] for x in (run_dir / "eval.jsonl").read_text().splitlines()] == [3, 6]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()


def test_adapter_loads_with_plain_peft(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    events = finish(run(make_config(tiny_model_dir, chat_file, tmp_path, max_steps=3)))
    adapter = events[-1].adapter_dir
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, tuned(ids).logits), "the trained adapter changes nothing"


def test_stopped_then_resumed_run_equals_uninterrupted(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    reference = Path(finish(run(make_config(tiny_model_dir, chat_file, tmp_path / "a")))[-1].run_dir)

    control = RunControl()
    stopped = []
    for event in run(make_config(tiny_model_dir, chat_file, tmp_path / "b"), control=control):
        stopped.append(event)
        if isinstance(event, StepMetrics) and event.step == 3:
            control.stop()
    assert isinstance(stopped[-1], RunFinished) and stopped[-1].cancelled and stopped[-1].step == 3
    run_dir = Path(stopped[-1].run_dir)
    finish(run(RunConfig(), resume=run_dir))
    assert_same_curve(losses(run_dir), losses(reference))


def test_crashed_run_resumes_from_last_checkpoint(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    reference = Path(finish(run(make_config(tiny_model_dir, chat_file, tmp_path / "a")))[-1].run_dir)
    events = run(make_config(tiny_model_dir, chat_file, tmp_path / "b"))
    for event in events:
        if isinstance(event, StepMetrics) and event.step == 5:
            break  # the process dies here: step 5 is logged, the last checkpoint is step 4
    events.close()
    run_dir = tmp_path / "b" / "run"
    assert len(losses(run_dir)) == 5
    resumed = finish(run(RunConfig(), resume=run_dir))
    assert next(e for e in resumed if isinstance(e, RunStarted)).start_step == 4
    assert_same_curve(losses(run_dir), losses(reference))


def test_pause_keeps_the_run_and_resume_continues(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    control = RunControl()
    seen = []
    for event in run(make_config(tiny_model_dir, chat_file, tmp_path, max_steps=4), control=control):
        seen.append(type(event).__name__)
        if isinstance(event, StepMetrics) and event.step == 2:
            control.pause()
        if isinstance(event, RunPaused):
            assert control.paused
            threading.Timer(0.3, control.resume).start()  # from another thread, once the run has stopped to wait
    assert seen.index("RunPaused") < seen.index("RunResumed") < seen.index("RunFinished")
    assert seen.count("StepMetrics") == 4
    assert RunResumed.__name__ in seen


def test_checkpoint_events_match_folders(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    events = finish(run(make_config(tiny_model_dir, chat_file, tmp_path, max_steps=4, save_every=1)))
    saved = [e for e in events if isinstance(e, CheckpointSaved)]
    assert [e.step for e in saved] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000003", "step-000004"]


def test_bad_dataset_ends_in_one_failed_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    events = list(run(make_config(tiny_model_dir, bad, tmp_path)))
    assert len(events) == 1 and isinstance(events[0], RunFailed)
    assert "row 1" in events[0].message and "assistant" in events[0].message


def test_missing_model_folder_fails_clearly(chat_file: Path, tmp_path: Path) -> None:
    events = list(run(make_config(tmp_path / "nope", chat_file, tmp_path)))
    assert isinstance(events[-1], RunFailed) and "not found" in events[-1].message


def test_existing_named_run_is_not_overwritten(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    finish(run(make_config(tiny_model_dir, chat_file, tmp_path, max_steps=1)))
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path, max_steps=1)))
    assert isinstance(events[-1], RunFailed) and "already exists" in events[-1].message


def test_grad_accumulation_weights_every_token_equally(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    """The step loss is the mean over all trained tokens of all micro-batches, not a mean of row means."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.data.model_inputs import stock_model_inputs
    from engine.data.prepare import RowSchedule, prepare_data

    answers = ["dog " * (i % 4 + 1) for i in range(12)]
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]} for a in answers]
    varied = write_jsonl(tmp_path / "varied.jsonl", rows)
    config = make_config(tiny_model_dir, varied, tmp_path, max_steps=1, grad_accum=3)
    config.data.tokens_per_batch = config.data.max_seq_len  # one document per row: rows differ in size
    config.training.device = "cpu"  # compared with a float32 reference below
    step = next(e for e in finish(run(config)) if isinstance(e, StepMetrics))
    # LoRA's B starts at zero, so the first step's loss is the base model's loss on the first three rows.
    data = prepare_data(config.data, AutoTokenizer.from_pretrained(tiny_model_dir), config.training.seed)
    schedule = RowSchedule(len(data.train_rows), config.training.seed)
    rows = [data.train_batch(schedule.row(i)) for i in range(3)]
    assert len({r.trained_tokens for r in rows}) > 1, "rows of equal size would not tell the two means apart"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        sums = [base(**stock_model_inputs(base, r), labels=r.labels, num_items_in_batch=1).loss for r in rows]
    summed = float(sum(sums))
    assert step.trained_tokens == sum(r.trained_tokens for r in rows)
    assert step.loss == pytest.approx(summed / step.trained_tokens, rel=1e-5)


def test_qlora_trains_on_cpu(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    config = make_config(tiny_model_dir, chat_file, tmp_path, max_steps=2)
    config.model.qlora = True
    events = finish(run(config))
    assert isinstance(events[-1], RunFinished)
    assert all(e.loss == e.loss for e in events if isinstance(e, StepMetrics))  # finite, not NaN


def test_speed_switches_flipped_mid_run_keep_the_loss_curve(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    from engine.config import SpeedConfig
    from engine.events import SpeedChanged

    reference = Path(finish(run(make_config(tiny_model_dir, chat_file, tmp_path / "a", max_steps=5)))[-1].run_dir)
    control = RunControl()
    changes = []
    for event in run(make_config(tiny_model_dir, chat_file, tmp_path / "b", max_steps=5), control=control):
        if isinstance(event, StepMetrics) and event.step == 2:
            control.request_speed(SpeedConfig(metadata_cache=False, checkpointing="standard"))
        if isinstance(event, SpeedChanged):
            changes.append(event)
    assert [c.step for c in changes] == [0, 2]
    assert changes[0].state["metadata_cache"]["on"] and not changes[1].state["metadata_cache"]["on"]
    assert changes[1].state["checkpointing"]["mode"] == "standard"
    assert_same_curve(losses(tmp_path / "b" / "run"), losses(reference))
