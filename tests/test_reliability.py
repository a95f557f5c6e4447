"""Faults injected into real runs of a tiny model: out of memory, NaN/inf losses and gradients, a full disk,
refused permissions and damaged checkpoints. Each test fails without the protection it names."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import resident_room

from engine.config import RunConfig
from engine.events import (
    CheckpointSaved,
    Notice,
    OomRecovered,
    RunFailed,
    RunFinished,
    SpeedChanged,
    StepMetrics,
    StepSkipped,
)
from engine.run import checkpoint as ckpt
from engine.run import guard
from engine.run import step as step_module
from engine.train import run


def make_config(model_dir: Path, data: Path, out: Path, data_overrides: dict | None = None, **training: object):
    raw = {
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.1},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0},
        "training": {"max_steps": 6, "learning_rate": 5e-3, "warmup_steps": 1, "save_every": 2, "eval_every": 3},
        "output": {"dir": str(out), "name": "run"},
    }
    raw["data"].update(data_overrides or {})
    raw["training"].update(training)
    return RunConfig.from_dict(raw)


def curve(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def assert_same_curve(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float = 1e-6) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel)


def failures(events: list) -> list[RunFailed]:
    return [e for e in events if isinstance(e, RunFailed)]


def adapter_is_finite(run_dir: Path) -> bool:
    from safetensors.torch import load_file

    weights = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    return all(torch.isfinite(w).all() for w in weights.values())


def wrap_forward(monkeypatch: pytest.MonkeyPatch, fault: Callable) -> None:
    """Route every forward of the run through ``fault(session, batch, num_items, real_forward)``."""
    real = step_module._forward_loss
    monkeypatch.setattr(step_module, "_forward_loss", lambda s, b, n: fault(s, b, n, real))


# --- out of memory ------------------------------------------------------------------------------------------


def test_split_row_keeps_order_and_budget() -> None:
    assert guard.split_row([10, 10, 10, 10], 40) == [[0, 1, 2, 3]]
    assert guard.split_row([10, 10, 10, 10], 25) == [[0, 1], [2, 3]]
    assert guard.split_row([30, 5, 5, 12], 20) == [[0], [1, 2], [3]]  # a too-long document stands alone


def test_out_of_memory_is_recognised_in_both_forms() -> None:
    assert guard.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert guard.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not guard.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not guard.is_out_of_memory(ValueError("out of memory"))


def oom_above(limit: int) -> Callable:
    def fault(session, batch, num_items, real):
        if batch.num_tokens > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch.num_tokens} MiB")
        return real(session, batch, num_items)

    return fault


def test_out_of_memory_step_is_retried_with_smaller_micro_batches(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of ~4 documents (~124 tokens) do not fit under a 70-token cap: the budget halves to 64 and the same
    documents are trained in two pieces, so the loss curve equals the run that never ran out of memory."""
    packed = {"tokens_per_batch": 128}
    reference = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "ref", packed)))
    assert not failures(reference)
    wrap_forward(monkeypatch, oom_above(70))
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "oom", packed)))
    assert not failures(events), failures(events)
    recovered = [e for e in events if isinstance(e, OomRecovered)]
    lowered = [(e.step, e.action, e.tokens_per_batch) for e in recovered]
    assert lowered == [(1, "retry", 128), (1, "tokens_per_batch", 64)]
    assert "same settings" in recovered[0].message and "64 tokens" in recovered[1].message
    logged = [json.loads(line) for line in (tmp_path / "oom" / "run" / "memory.jsonl").read_text().splitlines()]
    assert [(r["step"], r["action"]) for r in logged] == [(1, "retry"), (1, "tokens_per_batch")]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert_same_curve(curve(tmp_path / "oom" / "run"), curve(tmp_path / "ref" / "run"), rel=1e-5)
    last = ckpt.list_checkpoints(tmp_path / "oom" / "run" / "checkpoints")[-1]
    assert ckpt.load_trainer_state(last).tokens_per_batch == 64  # a resumed run keeps the lowered budget
    monkeypatch.undo()
    resumed = list(run(RunConfig(), resume=tmp_path / "oom" / "run"))
    assert any("stay at 64 tokens" in e.message for e in resumed if isinstance(e, Notice))


def test_out_of_memory_at_the_smallest_setting_stops_with_a_clear_message(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrap_forward(monkeypatch, oom_above(20))  # every document is longer: nothing can fit
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path, {"tokens_per_batch": 128})))
    actions = [(e.action, e.tokens_per_batch) for e in events if isinstance(e, OomRecovered)]
    assert actions[0] == ("retry", 128)  # released and tried as it was, once
    *lowered, offloaded, chunked = actions[1:]
    budgets = [budget for _, budget in lowered]
    smallest = budgets[-1]  # the longest document of the step: documents are never cut
    assert {kind for kind, _ in lowered} == {"tokens_per_batch"} and budgets[0] == 64
    assert budgets == sorted(budgets, reverse=True) and 28 <= smallest <= 32
    assert offloaded == ("offloaded_checkpointing", smallest) and chunked == ("chunked_mlp", smallest)
    speed = [e for e in events if isinstance(e, SpeedChanged)][-1]
    assert speed.state["checkpointing"]["mode"] != "none"  # offloaded where supported, recompute on CPU
    assert speed.state["chunked_mlp"]["on"]
    (failed,) = failures(events)
    assert "out of GPU memory at step 1" in failed.message and f"{smallest} tokens" in failed.message
    assert "chunks" in failed.message
    assert failed.hint and "QLoRA" in failed.hint
    assert not isinstance(events[-1], RunFinished)


def oom_until_chunked(fault_calls: list[int]) -> Callable:
    """Out of memory on every training forward until the per-token modules run in chunks (one long document that
    fits only that way)."""

    def fault(session, batch, num_items, real):
        if session.model.training and not session.speed.state()["chunked_mlp"]["on"]:
            fault_calls.append(session.step + 1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB")
        return real(session, batch, num_items)

    return fault


def test_a_document_that_fits_only_in_chunks_trains_after_switching_them_on(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Splitting rows and offloading are tried first; then the MLPs go to chunks, the run finishes every step, and
    its losses are those of a run with chunks on from the start."""
    packed = {"tokens_per_batch": 48}
    chunked = make_config(tiny_model_dir, chat_file, tmp_path / "ref", packed)
    chunked = dataclasses.replace(chunked, speed=dataclasses.replace(chunked.speed, chunked_mlp=True))
    assert not failures(list(run(chunked)))
    calls: list[int] = []
    wrap_forward(monkeypatch, oom_until_chunked(calls))
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "oom", packed)))
    assert not failures(events), failures(events)
    actions = [e.action for e in events if isinstance(e, OomRecovered)]
    assert actions[-2:] == ["offloaded_checkpointing", "chunked_mlp"] and set(calls) == {1}
    assert "chunks" in [e for e in events if isinstance(e, OomRecovered)][-1].message
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert_same_curve(curve(tmp_path / "oom" / "run"), curve(tmp_path / "ref" / "run"), rel=1e-4)


def test_running_short_with_resident_layers_checkpoints_every_layer_and_retries_the_same_rows(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resident layers are the next remedy after step graphs: the step runs again with every layer checkpointed and
    the same micro-batches (no smaller budget), so the losses are those of a checkpointed run."""
    packed = {"tokens_per_batch": 48}
    checkpointed = make_config(tiny_model_dir, chat_file, tmp_path / "ref", packed)
    checkpointed = dataclasses.replace(checkpointed, speed=dataclasses.replace(checkpointed.speed,
                                                                             checkpointing="offloaded"))  # fmt: skip
    assert not failures(list(run(checkpointed)))
    resident_room(monkeypatch, from_start=True)  # as if a GPU had room for one layer
    calls: list[int] = []

    def fault(session, batch, num_items, real):
        if session.model.training and session.speed.resident_layers:
            calls.append(session.step + 1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB")
        return real(session, batch, num_items)

    wrap_forward(monkeypatch, fault)
    config = dataclasses.replace(
        checkpointed, output=dataclasses.replace(checkpointed.output, dir=str(tmp_path / "oom"))
    )
    events = list(run(config))
    assert not failures(events), failures(events)
    recovered = [e.action for e in events if isinstance(e, OomRecovered)]
    assert calls == [1, 1] and recovered == ["retry", "resident_layers"]  # tried as it was, then no budget lowered
    states = [e.state["resident_layers"] for e in events if isinstance(e, SpeedChanged)]
    assert states and not states[-1]["on"] and "ran short" in states[-1]["reason"]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert_same_curve(curve(tmp_path / "oom" / "run"), curve(tmp_path / "ref" / "run"), rel=1e-5)


def test_choices_made_at_the_first_batch_are_announced_after_its_step(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Switches that wait for the first batch (resident layers here; automatic checkpointing on a GPU) change the
    state after the run's first announcement: the run says so after that step, not only when step graphs decide."""
    resident_room(monkeypatch)  # as if a GPU had room for one layer: sized when the first batch arrives
    config = make_config(tiny_model_dir, chat_file, tmp_path, {"tokens_per_batch": 48})
    config = dataclasses.replace(config, speed=dataclasses.replace(config.speed, checkpointing="offloaded"))
    events = list(run(config))
    assert not failures(events), failures(events)
    changes = [(e.step, e.state["resident_layers"]) for e in events if isinstance(e, SpeedChanged)]
    assert [step for step, _ in changes] == [0, 1], changes
    assert not changes[0][1]["on"] and changes[1][1]["on"] and changes[1][1]["layers"] == 1


def test_the_first_steps_one_off_work_is_announced_only_where_there_is_some() -> None:
    from engine.run.session import warm_up_note

    compiled = {"fused_kernels": {"on": True}, "step_graphs": {"on": False, "reason": "switched off"}}
    assert warm_up_note(compiled) == (
        "the first steps compile this model's fused GPU kernels (50-90 s for an 8B model on an H200); "
        "the steps after them run at full speed"
    )
    both = {**compiled, "step_graphs": {"on": True, "reason": "automatic: trying; a replayed micro-batch is ..."}}
    assert "kernels (50-90 s for an 8B model on an H200) and time step graphs against eager steps;" in str(
        warm_up_note(both)
    )
    kept = {"fused_kernels": {"on": False}, "step_graphs": {"on": True, "reason": "switched on: each micro-batch"}}
    assert warm_up_note(kept) is None and warm_up_note({}) is None


def test_a_cpu_run_has_no_warm_up_to_announce(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    assert not failures(events)
    assert not [e for e in events if isinstance(e, Notice) and e.message.startswith("the first steps")]


def test_other_errors_in_a_step_are_not_mistaken_for_out_of_memory(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fault(session, batch, num_items, real):
        raise RuntimeError("an illegal memory access was encountered")

    wrap_forward(monkeypatch, fault)
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    assert not any(isinstance(e, OomRecovered) for e in events)
    assert "illegal memory access" in failures(events)[0].message


# --- NaN and inf --------------------------------------------------------------------------------------------


def poison_training_calls(bad: Callable[[int], bool], gradient_only: bool = False) -> Callable:
    """Make the n-th training forward (1-based, eval excluded) return a NaN loss, or a NaN gradient only."""
    calls = {"n": 0}

    def fault(session, batch, num_items, real):
        loss = real(session, batch, num_items)
        if not session.model.training:
            return loss
        calls["n"] += 1
        if not bad(calls["n"]):
            return loss
        if gradient_only:  # finite value, NaN gradient: d/dx sqrt(0 * x) = inf * 0
            param = session.trainable[0]
            return loss + torch.sqrt((param * 0).sum())
        return loss * float("nan")

    return fault


@pytest.mark.parametrize("gradient_only", [False, True], ids=["nan-loss", "nan-gradient"])
def test_a_non_finite_step_is_skipped_and_the_run_goes_on(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gradient_only: bool
) -> None:
    wrap_forward(monkeypatch, poison_training_calls(lambda n: n == 3, gradient_only))
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    assert not failures(events), failures(events)
    (skipped,) = [e for e in events if isinstance(e, StepSkipped)]
    assert (skipped.step, skipped.consecutive, skipped.total_skipped) == (3, 1, 1)
    assert not math.isfinite(skipped.grad_norm) if gradient_only else not math.isfinite(skipped.loss)
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(s.loss) and math.isfinite(s.grad_norm) for s in steps)
    assert adapter_is_finite(tmp_path / "run")


def test_non_finite_steps_in_a_row_stop_the_run_and_keep_the_last_checkpoint(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrap_forward(monkeypatch, poison_training_calls(lambda n: n >= 5))
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path, max_bad_steps=3)))
    assert [e.consecutive for e in events if isinstance(e, StepSkipped)] == [1, 2, 3]
    (failed,) = failures(events)
    assert "not finite" in failed.message and "3 steps in a row from step 5" in failed.message
    assert "step-000004" in failed.message and failed.step == 4
    run_dir = tmp_path / "run"
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == ["step-000002", "step-000004"]
    assert all(ckpt.checkpoint_problem(p) is None for p in saved)
    assert not (run_dir / "adapter").exists()
    monkeypatch.undo()
    resumed = list(run(RunConfig(), resume=run_dir))
    assert not failures(resumed) and isinstance(resumed[-1], RunFinished) and resumed[-1].step == 6
    assert adapter_is_finite(run_dir)


# --- full disk and refused writes ---------------------------------------------------------------------------


def fail_on_call(number: int, err: OSError, real: Callable) -> Callable:
    calls = {"n": 0}

    def writer(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == number:
            raise err
        return real(*args, **kwargs)

    return writer


def test_full_disk_during_a_checkpoint_keeps_the_previous_one_and_resumes(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    assert not failures(list(run(make_config(tiny_model_dir, chat_file, tmp_path / "ref"))))
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_call(2, full, safetensors.torch.save_file))
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    (failed,) = failures(events)
    folder = tmp_path / "run" / "checkpoints"
    assert failed.message == f"the disk is full: cannot write the checkpoint step-000004 to {folder}"
    assert failed.hint and "intact" in failed.hint and failed.step == 4
    assert [e.step for e in events if isinstance(e, CheckpointSaved)] == [2]
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002"]  # no half-written or temporary folder
    assert ckpt.checkpoint_problem(folder / "step-000002") is None
    monkeypatch.undo()
    assert not failures(list(run(RunConfig(), resume=tmp_path / "run")))
    assert_same_curve(curve(tmp_path / "run"), curve(tmp_path / "ref" / "run"))


def test_permission_denied_on_a_checkpoint_file_stops_with_where(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    denied = PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(torch, "save", fail_on_call(1, denied, torch.save))  # optimizer.pt of the first checkpoint
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    (failed,) = failures(events)
    folder = tmp_path / "run" / "checkpoints"
    assert failed.message == f"permission denied: cannot write the checkpoint step-000002 to {folder}"
    assert list(folder.iterdir()) == []
    assert not (tmp_path / "run" / "error.log").exists()  # a user-facing error, not a crash


def test_full_disk_for_the_training_log_and_the_best_and_final_adapters(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = Path.open

    def open_refusing_metrics(self: Path, mode: str = "r", *args, **kwargs):
        if self.name == "metrics.jsonl" and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_refusing_metrics)
    (failed,) = failures(list(run(make_config(tiny_model_dir, chat_file, tmp_path / "a"))))
    assert failed.message.startswith("the disk is full: cannot write the training log metrics.jsonl")
    monkeypatch.undo()

    from engine.run import folder as run_folder

    def refuse(tensors, filename, **kwargs):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    real_save = run_folder.save_file
    # the first evaluation's best adapter is the first adapter written
    monkeypatch.setattr(run_folder, "save_file", refuse)
    (failed,) = failures(list(run(make_config(tiny_model_dir, chat_file, tmp_path / "b"))))
    run_dir = tmp_path / "b" / "run"
    assert failed.message == f"the disk is full: cannot write the best adapter to {run_dir / 'adapter-best'}"
    assert sorted(p.name for p in run_dir.iterdir() if "adapter" in p.name) == []  # nothing half-written
    assert ckpt.checkpoint_problem(ckpt.list_checkpoints(run_dir / "checkpoints")[-1]) is None

    def refuse_the_final_adapter(tensors, filename, **kwargs):
        if "adapter-best" in str(filename):
            return real_save(tensors, filename, **kwargs)
        return refuse(tensors, filename, **kwargs)

    monkeypatch.setattr(run_folder, "save_file", refuse_the_final_adapter)
    (failed,) = failures(list(run(make_config(tiny_model_dir, chat_file, tmp_path / "c"))))
    run_dir = tmp_path / "c" / "run"
    assert failed.message == f"the disk is full: cannot write the final adapter to {run_dir / 'adapter'}"
    assert sorted(p.name for p in run_dir.iterdir() if "adapter" in p.name) == ["adapter-best"]
    assert ckpt.checkpoint_problem(ckpt.list_checkpoints(run_dir / "checkpoints")[-1]) is None


# --- damaged and interrupted checkpoints --------------------------------------------------------------------


def test_a_damaged_latest_checkpoint_is_skipped_on_resume(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    assert not failures(list(run(make_config(tiny_model_dir, chat_file, tmp_path / "ref"))))
    control_events = list(run(make_config(tiny_model_dir, chat_file, tmp_path, max_steps=6, save_every=2)))
    assert not failures(control_events)
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    latest = ckpt.list_checkpoints(folder)[-1]
    assert latest.name == "step-000006"
    weights = latest / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a bad sector, a copy cut short
    assert "adapter.safetensors is damaged" in (ckpt.checkpoint_problem(latest) or "")
    (run_dir / "adapter").rename(run_dir / "adapter-first")
    resumed = list(run(RunConfig(), resume=run_dir))
    assert not failures(resumed)
    notices = [e.message for e in resumed if isinstance(e, Notice)]
    assert any("step-000006 was skipped: adapter.safetensors is damaged" in m for m in notices)
    assert [e.start_step for e in resumed if hasattr(e, "start_step")] == [4]
    assert_same_curve(curve(run_dir), curve(tmp_path / "ref" / "run"))


def test_a_kill_between_the_two_renames_of_a_replace_is_undone(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    (folder / ".old-step-000004").mkdir(parents=True)
    (folder / ".old-step-000004" / ckpt.STATE_FILE).write_text("{}")
    (folder / ".tmp-step-000004").mkdir()
    (folder / ".trash-step-000002").mkdir()
    assert ckpt.list_checkpoints(folder) == []
    ckpt.recover_interrupted(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000004"]


def test_a_kill_before_the_first_checkpoint_resumes_from_the_start(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_model_dir, chat_file, tmp_path, max_steps=3, save_every=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config.save(run_dir / "config.json")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')  # torn by the kill
    events = list(run(RunConfig(), resume=run_dir))
    assert not failures(events)
    assert any("no usable checkpoint yet" in e.message for e in events if isinstance(e, Notice))
    assert [s for s, _ in curve(run_dir)] == [1, 2, 3] and curve(run_dir)[0][1] != 9.0
