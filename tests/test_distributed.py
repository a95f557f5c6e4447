"""Several processes (gloo, CPU) against one: the same loss curve, resuming across process counts, stop, crash.

A two-process run must train exactly the model a one-process run trains on the same global batch: each step's
rows are shared out across the ranks and the gradients summed, so the curves agree to float32 reduction noise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from hang import HANG_S
from helpers import write_jsonl

from engine import events as ev
from engine.config import RunConfig
from engine.distributed.group import choose_mode
from engine.distributed.launch import LAUNCH_ENV, event_from_dict, resolve_gpus
from engine.errors import ConfigError
from engine.events import RunFailed, RunFinished, RunPaused, RunResumed, SpeedChanged, StepMetrics
from engine.run.control import RunControl
from engine.run.ranks import FAULT_ENV, Ranks
from engine.train import run

REL = 1e-5


@pytest.fixture
def varied_chat(tmp_path: Path) -> Path:
    """Conversations of different lengths, so rows differ in trained tokens (normalization must be global)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"say {i}" + " ok" * (i % 3)},
                {"role": "assistant", "content": f"number {i}" + " yes" * (i % 4)},
            ]
        }
        for i in range(30)
    ]
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def make_config(
    model: Path,
    data: Path,
    out: Path,
    name: str,
    dtype: str = "float32",
    speed: dict[str, object] | None = None,
    **training: object,
) -> RunConfig:
    raw = {
        "model": {"name": str(model), "dtype": dtype},
        "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": 96, "eval_fraction": 0.1},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0},
        "training": {
            "max_steps": 5,
            "learning_rate": 5e-3,
            "warmup_steps": 1,
            "save_every": 2,
            "eval_every": 3,
            "grad_accum": 2,
            "device": "cpu",
            **training,
        },
        "output": {"dir": str(out), "name": name},
        "speed": speed or {},
    }
    return RunConfig.from_dict(raw)


def finished(events: list[ev.Event]) -> RunFinished:
    failed = [e for e in events if isinstance(e, RunFailed)]
    assert not failed, failed
    assert isinstance(events[-1], RunFinished)
    return events[-1]


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, gradient norm) of each logged step: Adam hides a wrongly scaled gradient from the loss."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def assert_same_curve(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    assert [v for _, v, _ in got] == pytest.approx([v for _, v, _ in want], rel=REL)
    assert [g for _, _, g in got] == pytest.approx([g for _, _, g in want], rel=1e-4)


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def training_processes(folder: Path | None) -> list[str]:
    """torchrun and rank processes under this test, or anywhere running a run in ``folder`` (orphans included);
    torch.compile's worker pool is not one of them."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    found = []
    for process in psutil.process_iter():
        try:
            command = " ".join(process.cmdline())
            if not any(mark in command for mark in ("torch.distributed.run", "engine.distributed", "bench_multi_gpu")):
                continue
            if process.pid in mine or (folder and str(folder) in process.environ().get(LAUNCH_ENV, "")):
                found.append(command)
        except psutil.Error:  # gone meanwhile, or not ours to inspect
            continue
    return found


def assert_no_children(folder: Path | None = None) -> None:
    deadline = time.monotonic() + HANG_S
    while training_processes(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert training_processes(folder) == []


@pytest.mark.parametrize(
    ("parallel", "grad_accum"),
    [("ddp", 2), ("ddp", 3), ("fsdp", 2)],
    ids=["ddp", "ddp-uneven-rows", "fsdp2"],
)
def test_two_processes_train_what_one_trains(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path, parallel: str, grad_accum: int
) -> None:
    one = finished(list(run(make_config(tiny_model_dir, varied_chat, tmp_path, "one", grad_accum=grad_accum))))
    config = make_config(
        tiny_model_dir, varied_chat, tmp_path, "two", grad_accum=grad_accum, gpus="2", parallel=parallel
    )
    events = list(run(config))
    two = finished(events)
    assert_same_curve(curve(Path(two.run_dir)), curve(Path(one.run_dir)))
    assert two.eval_loss == pytest.approx(one.eval_loss, rel=REL)
    want, got = adapter(Path(one.run_dir)), adapter(Path(two.run_dir))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert all(s.rank_memory_bytes is not None and len(s.rank_memory_bytes) == 2 for s in steps)
    assert all(s.memory_bytes == max(s.rank_memory_bytes or []) for s in steps)
    # rank 0's busy time is a part of its own step (another rank's may start earlier than rank 0's step)
    assert all(len(s.rank_busy_s or []) == 2 and min(s.rank_busy_s or []) > 0 for s in steps)
    assert all(0 < (s.rank_busy_s or [0])[0] <= s.step_time_s for s in steps)
    assert sorted(p.name for p in (Path(two.run_dir) / "checkpoints").iterdir()) == ["step-000004", "step-000005"]
    assert_no_children(tmp_path)

    # the step-4 checkpoint the ranks wrote (gathered whole under FSDP2) resumes in one process
    copy = tmp_path / "resumed"
    shutil.copytree(two.run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step-000005")
    finished(list(run(RunConfig(), resume=copy)))
    assert_same_curve(curve(copy), curve(Path(one.run_dir)))


LONG_RUN_STEPS = 300


def test_paused_changed_and_stopped_ranks_resume_on_one_process(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path
) -> None:
    # room for the requests to land mid-run: they reach the ranks through a file polled every 0.1 s, and a tiny
    # model's step takes ~20 ms on two cores (30 steps once ended before the stop arrived)
    steps = {"max_steps": LONG_RUN_STEPS, "eval_every": 0, "save_every": 0}
    reference = finished(list(run(make_config(tiny_model_dir, varied_chat, tmp_path / "a", "run", **steps))))
    control = RunControl()
    seen: list[ev.Event] = []
    config = make_config(tiny_model_dir, varied_chat, tmp_path / "b", "run", gpus="2", **steps)
    for event in run(config, control=control):
        seen.append(event)
        if isinstance(event, StepMetrics) and event.step == 1:
            control.pause()
        elif isinstance(event, RunPaused):
            control.resume()
        elif isinstance(event, RunResumed):
            control.request_speed(dataclasses.replace(config.speed, metadata_cache=False))
        elif isinstance(event, SpeedChanged) and not event.state["metadata_cache"]["on"]:
            control.stop()
    stopped = finished(seen)
    assert stopped.cancelled and 1 <= stopped.step < LONG_RUN_STEPS
    assert any(isinstance(e, RunPaused) for e in seen) and any(isinstance(e, RunResumed) for e in seen)
    changed = [e for e in seen if isinstance(e, SpeedChanged)]
    assert [e.state["metadata_cache"]["on"] for e in changed] == [True, False]
    assert (Path(stopped.run_dir) / "checkpoints" / f"step-{stopped.step:06d}").is_dir()
    assert not (Path(stopped.run_dir) / "control.json").exists()
    assert_no_children(tmp_path)

    resumed = finished(list(run(config_with_gpus(config, "1"), resume=stopped.run_dir)))
    assert not resumed.cancelled and resumed.step == LONG_RUN_STEPS
    assert_same_curve(curve(Path(resumed.run_dir)), curve(Path(reference.run_dir)))


def config_with_gpus(config: RunConfig, gpus: str) -> RunConfig:
    raw = config.to_dict()
    raw["training"]["gpus"] = gpus
    return RunConfig.from_dict(raw)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_process_checkpoint_resumes_on_two(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path, parallel: str
) -> None:
    reference = finished(list(run(make_config(tiny_model_dir, varied_chat, tmp_path / "a", "run", max_steps=6))))
    control = RunControl()
    config = make_config(tiny_model_dir, varied_chat, tmp_path / "b", "run", max_steps=6)
    for event in run(config, control=control):
        if isinstance(event, StepMetrics) and event.step == 3:
            control.stop()
    two = RunConfig.from_dict({"training": {"gpus": "2", "parallel": parallel}})  # a resume keeps all else
    resumed = finished(list(run(two, resume=tmp_path / "b" / "run")))
    assert_same_curve(curve(Path(resumed.run_dir)), curve(Path(reference.run_dir)))


LAUNCHER = """
import sys
from engine.config import RunConfig
from engine.train import run
for event in run(RunConfig.load(sys.argv[1])):
    print(type(event).__name__, flush=True)
"""


def test_ranks_save_and_exit_when_the_launcher_is_killed(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path
) -> None:
    """An app killed outright leaves no training processes behind: rank 0 sees it gone and stops the run."""
    config = make_config(tiny_model_dir, varied_chat, tmp_path, "orphan", gpus="2", max_steps=100_000, eval_every=0)
    config.save(tmp_path / "launch.json")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "launch.json")], stdout=subprocess.PIPE, text=True, env=env
    )
    assert launcher.stdout is not None
    for line in launcher.stdout:
        if line.startswith("StepMetrics"):
            break
    ranks = psutil.Process(launcher.pid).children(recursive=True)
    assert len(ranks) >= 3  # torchrun and its two ranks
    launcher.kill()
    launcher.wait()
    _, alive = psutil.wait_procs(ranks, timeout=HANG_S)
    assert alive == []
    assert list((tmp_path / "orphan" / "checkpoints").glob("step-*")), "the stop saved no checkpoint"


def test_a_rank_that_dies_fails_the_run_and_leaves_no_process(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:2")
    events = list(run(make_config(tiny_model_dir, varied_chat, tmp_path, "crash", gpus="2")))
    failed = events[-1]
    assert isinstance(failed, RunFailed), events[-3:]
    assert failed.message == "the training process of rank 1 stopped unexpectedly (exit code 3)"
    assert failed.run_dir == str(tmp_path / "crash")
    assert [e.step for e in events if isinstance(e, StepMetrics)] in ([], [1])
    assert_no_children(tmp_path)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_row_of_a_step_is_trained_once_by_some_rank(world: int) -> None:
    for rows in ([7], [1, 2], [3, 4, 5], [0, 1, 2, 3, 4, 5, 6]):
        shares = [Ranks(rank=r, world=world).share(rows) for r in range(world)]
        assert sorted(row for share in shares for row in share) == sorted(rows)
        passes = Ranks(rank=0, world=world).passes([1] * len(rows))
        assert passes == max(len(share) for share in shares) == -(-len(rows) // world)


def test_qlora_under_fsdp2_is_refused_with_a_hint() -> None:
    config = RunConfig.from_dict({"model": {"qlora": True}, "training": {"parallel": "fsdp"}})
    with pytest.raises(ConfigError, match="QLoRA") as caught:
        choose_mode(Ranks(world=2), config, torch.device("cuda", 0))
    assert "--parallel ddp" in (caught.value.hint or "")
    auto = choose_mode(Ranks(world=2), RunConfig(), torch.device("cpu"))
    assert (auto.mode, auto.reason) == ("ddp", "auto: DDP")


def test_every_event_survives_the_trip_from_rank_zero() -> None:
    samples = [
        ev.StepMetrics(3, 9, 0.5, 1.25, 1e-4, 0.7, 96, 40, 0.1, 960.0, 123, [120, 123]),
        ev.SpeedChanged(2, {"fused_loss": {"on": True, "reason": "x"}}),
        ev.RunFinished(9, "r", "r/adapter", None, 1.0, 2.0, cancelled=True),
        ev.RunFailed("boom", None, 0, None),
        ev.NodeFigures(3, ["CPU", "2 × GPU"], [0.2, 0.5], [10, 30], 1, 0.3),
    ]
    for event in samples:
        assert event_from_dict(json.loads(json.dumps(event.to_dict()))) == event


@pytest.mark.parametrize("spec", ["0", "-1", "two", "1,1", "1,", ""])
def test_bad_gpu_choices_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"training\.gpus"):
        RunConfig.from_dict({"training": {"gpus": spec}})


def test_gpu_choices_on_the_cpu() -> None:
    assert resolve_gpus("2", "cpu") == [0, 1]
    assert resolve_gpus("all", "cpu") == [0]
    assert resolve_gpus("0,1", "cpu") == [0, 1]
    assert RunConfig.from_dict({"training": {"gpus": "all", "parallel": "fsdp"}}).training.parallel == "fsdp"


def test_scaling_bench_runs_on_cpu_processes(tmp_path: Path) -> None:
    from engine.bench.multi_gpu import main

    out = tmp_path / "scaling"
    argv = ["--shape=tiny", "--device=cpu", "--gpus=2", "--tokens=256", "--steps=2", "--warmup=1", "--speed=auto"]
    assert main([*argv, f"--out={out}"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [r["gpus"] for r in report["results"]] == [1, 2]
    assert report["ratio"] == pytest.approx(report["results"][1]["tokens_per_s"] / report["results"][0]["tokens_per_s"])
    assert all(len(r["step_ms"]) == 2 and r["tokens_per_s"] > 0 for r in report["results"])
    assert "tokens/s" in out.with_suffix(".md").read_text()
    assert_no_children()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_two_gpus_train_what_one_gpu_trains(tiny_model_dir: Path, varied_chat: Path, tmp_path: Path) -> None:
    """bf16 on CUDA with NCCL: DDP's and FSDP2's curves equal one GPU's within bf16 noise.

    Fused kernels stay off: their compile takes about 75 s per process on the H200 machines, and the scaling bench
    runs them under DDP already."""
    cuda = {"dtype": "bfloat16", "device": "auto", "max_steps": 6, "speed": {"fused_kernels": False}}
    one = finished(list(run(make_config(tiny_model_dir, varied_chat, tmp_path, "one", **cuda))))
    want = curve(Path(one.run_dir))
    problems = {}
    for parallel in ("ddp", "fsdp"):  # both run before any assertion: one GPU session answers for both
        config = make_config(tiny_model_dir, varied_chat, tmp_path, parallel, gpus="2", parallel=parallel, **cuda)
        events = list(run(config))
        try:
            two = finished(events)
            got = curve(Path(two.run_dir))
            assert [s for s, _, _ in got] == [s for s, _, _ in want]
            assert [v for _, v, _ in got] == pytest.approx([v for _, v, _ in want], rel=2e-2)
            steps = [e for e in events if isinstance(e, StepMetrics)]
            assert all(len(s.rank_memory_bytes or []) == 2 and min(s.rank_memory_bytes or [0]) > 0 for s in steps)
            assert adapter(Path(two.run_dir)).keys() == adapter(Path(one.run_dir)).keys()
            print(parallel, "losses", [round(v, 4) for _, v, _ in got], "one GPU", [round(v, 4) for _, v, _ in want])
        except AssertionError as err:
            problems[parallel] = str(err)[:2000]
        assert_no_children(tmp_path)
    assert not problems, problems


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_a_gpu_that_hands_over_its_gradients_late_shows_as_the_busier_rank(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs the busy time is read on the device's clock (a CUDA event at the last gradient bucket): rank 1's late
    hand-over counts as its work, and rank 0's wait for it does not."""
    from engine.run.busy import SLOW_ENV

    delay_s = 0.3
    monkeypatch.setenv(SLOW_ENV, f"1:{delay_s}")
    cuda = {"dtype": "bfloat16", "device": "auto", "max_steps": 3, "speed": {"fused_kernels": False}}
    config = make_config(tiny_model_dir, varied_chat, tmp_path, "ddp", gpus="2", parallel="ddp", **cuda)
    events = list(run(config))
    finished(events)
    for step in [e for e in events if isinstance(e, StepMetrics)]:
        busy = step.rank_busy_s or []
        assert len(busy) == 2 and busy[1] - busy[0] > delay_s / 2, step
        assert busy[0] < step.step_time_s - delay_s / 2, step
    assert_no_children(tmp_path)
