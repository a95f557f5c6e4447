"""A training process killed with SIGKILL at random moments (mid-step, mid-checkpoint) always resumes from a
whole checkpoint and continues the same loss curve as a run that was never interrupted.

The kill times are drawn from a seeded generator and the number of kills is fixed, so the test is repeatable
and bounded (under a minute on two CPU cores, most of it starting Python processes).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hang import HANG_S
from helpers import write_jsonl

from engine.config import RunConfig
from engine.events import RunFailed, RunFinished
from engine.run import checkpoint as ckpt
from engine.train import run

KILLS = 5
SEED = 8
CHAT_ROWS = [  # the same rows as the chat_file fixture
    {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"number {i}"}]}
    for i in range(24)
]

CHILD = """
import sys
from engine.config import RunConfig
from engine.events import RunFailed, RunStarted
from engine.train import run

target = sys.argv[1]
events = run(RunConfig(), resume=target) if sys.argv[2] == "resume" else run(RunConfig.load(target))
for event in events:
    if isinstance(event, RunStarted):
        print("started", event.start_step, flush=True)
    elif isinstance(event, RunFailed):
        print("failed", event.message, flush=True)
        sys.exit(3)
print("finished", flush=True)
"""


# Dies by SIGKILL at an exact point of writing checkpoint step-000006, then runs CHILD.
DIE_WHILE_SAVING = (
    """
import os, shutil, signal, sys
from pathlib import Path
import torch

point = sys.argv.pop()

def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)

if point == "file":  # the optimizer state of step 6 is half written
    real_save = torch.save
    def save(obj, path, *args, **kwargs):
        if ".tmp-step-000006" in str(path) and str(path).endswith("scheduler.pt"):
            Path(path).write_bytes(b"half")
            die()
        return real_save(obj, path, *args, **kwargs)
    torch.save = save
elif point == "rename":  # every file written and fsynced, the folder not yet renamed into place
    real_rename = Path.rename
    def rename(self, target):
        if Path(target).name == "step-000006":
            die()
        return real_rename(self, target)
    Path.rename = rename
elif point == "prune":  # step 6 in place, step 2 half deleted
    real_rmtree = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        if Path(path).name == ".trash-step-000002":
            next(Path(path).iterdir()).unlink()
            die()
        return real_rmtree(path, *args, **kwargs)
    shutil.rmtree = rmtree
"""
    + CHILD
)


def make_config(model_dir: Path, data: Path, out: Path) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir)},
            "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.1},
            "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1},  # dropout: the RNG state must resume exactly too
            "training": {"max_steps": 20, "learning_rate": 5e-3, "warmup_steps": 2, "save_every": 2, "eval_every": 8},
            "output": {"dir": str(out), "name": "run", "keep_checkpoints": 2},
        }
    )


def curve(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def logged_steps(run_dir: Path) -> int:
    """Steps with a whole line in metrics.jsonl (a torn last line does not count)."""
    count = 0
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            count = json.loads(line)["step"]
        except ValueError:
            break
    return count


def start_child(target: Path, mode: str, script: str = CHILD, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-c", script, str(target), mode, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def kill_after_start(child: subprocess.Popen[str], delay: float) -> str:
    """Wait until the run has started training, then SIGKILL it after ``delay`` seconds (unless it ended first)."""
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.startswith("started"), f"child did not start: {line!r}"
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.005)
    if child.poll() is None:
        child.send_signal(signal.SIGKILL)
    child.wait(timeout=HANG_S)
    return line.strip()


def check_every_checkpoint_is_whole(run_dir: Path) -> int:
    saved = ckpt.list_checkpoints(run_dir / "checkpoints")
    for checkpoint in saved:
        assert ckpt.checkpoint_problem(checkpoint) is None, checkpoint
    return ckpt.load_trainer_state(saved[-1]).step if saved else 0


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[int, float]], float]:
    """The loss curve and wall time of the run never interrupted."""
    folder = tmp_path_factory.mktemp("reference")
    data = write_jsonl(folder / "chat.jsonl", CHAT_ROWS)
    events = list(run(make_config(tiny_model_dir, data, folder)))
    assert isinstance(events[-1], RunFinished), events[-1]
    return curve(folder / "run"), events[-1].wall_time_s


@pytest.mark.slow
def test_sigkill_at_random_moments_resumes_the_same_curve(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], reference
) -> None:
    want, run_time = reference
    config = make_config(tiny_model_dir, chat_file, tmp_path / "killed")
    config_file = tmp_path / "config.json"
    config.save(config_file)
    run_dir = tmp_path / "killed" / "run"
    rng = random.Random(SEED)
    report = []
    for trial in range(KILLS):
        # each life gets a slice of the run, so the kills spread over the whole run and the run makes progress
        delay = rng.uniform(0.2, 1.0) * run_time / KILLS
        child = start_child(config_file if trial == 0 else run_dir, "new" if trial == 0 else "resume")
        started = kill_after_start(child, delay)
        resumable = check_every_checkpoint_is_whole(run_dir)
        logged = logged_steps(run_dir)
        report.append((trial + 1, started, round(delay, 3), child.returncode, logged, resumable, logged - resumable))
    finished = list(run(RunConfig(), resume=run_dir))
    assert not [e for e in finished if isinstance(e, RunFailed)], finished
    assert isinstance(finished[-1], RunFinished) and finished[-1].step == 20
    got = curve(run_dir)
    assert [s for s, _ in got] == list(range(1, 21))
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    with capsys.disabled():
        print("\ntrial, start, kill after s, exit code, steps logged, resumable step, steps lost")
        for row in report:
            print(*row, sep=", ")
    killed = [row for row in report if row[3] == -signal.SIGKILL]
    assert len(killed) >= KILLS - 1  # the kills landed while the run was going


@pytest.mark.slow
@pytest.mark.parametrize(("point", "resumed_from"), [("file", 4), ("rename", 4), ("prune", 6)])
def test_sigkill_inside_a_checkpoint_write_resumes_from_a_whole_one(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, point: str, resumed_from: int, reference
) -> None:
    config = make_config(tiny_model_dir, chat_file, tmp_path / "killed")
    config_file = tmp_path / "config.json"
    config.save(config_file)
    child = start_child(config_file, "new", DIE_WHILE_SAVING, point)
    child.communicate(timeout=HANG_S)
    assert child.returncode == -signal.SIGKILL
    run_dir = tmp_path / "killed" / "run"
    assert check_every_checkpoint_is_whole(run_dir) == resumed_from
    finished = list(run(RunConfig(), resume=run_dir))
    assert isinstance(finished[-1], RunFinished), finished[-1]
    assert next(e.start_step for e in finished if hasattr(e, "start_step")) == resumed_from
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000018", "step-000020"]
    got, want = curve(run_dir), reference[0]
    assert [s for s, _ in got] == list(range(1, 21))
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
