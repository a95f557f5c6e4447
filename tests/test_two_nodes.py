"""Two computers as one run, played by two launcher processes on this machine (gloo, CPU, a rendezvous on a free port).

Each node is ``python -m engine.cli train ... --nodes 2 --node-rank R --rendezvous 127.0.0.1:PORT --json``, as a user
types it on each computer. The run must train exactly what one process trains on the same global batch, stop both
nodes when one goes, resume on one machine along the same curve, refuse nodes that would train different things,
and fail soon with a hint when nobody answers at the rendezvous.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hang import HANG_S
from helpers import write_jsonl
from test_distributed import adapter, assert_same_curve, curve, finished, make_config, varied_chat  # noqa: F401

from engine.config import RunConfig
from engine.run.ranks import FAULT_ENV
from engine.train import run

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
NODE_TIMEOUT_S = 3.0
"""The lost-node bound the fault tests run with: short, so that a test waits seconds, not the default 30."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def base_flags(model: Path, data: Path, out: Path, steps: int = STEPS) -> list[str]:
    """The flags of ``make_config`` (tests/test_distributed.py) as a user types them."""
    return [
        f"--model={model}",
        f"--data={data}",
        "--model-dtype=float32",
        "--max-seq-len=64",
        "--tokens-per-batch=96",
        "--eval-fraction=0.1",
        "--lora-rank=4",
        "--lora-alpha=8",
        "--lora-dropout=0",
        f"--max-steps={steps}",
        "--lr=5e-3",
        "--warmup-steps=1",
        "--save-every=2",
        "--eval-every=3",
        "--grad-accum=2",
        "--device=cpu",
        f"--output={out}",
        "--name=run",
    ]


class Node:
    """One node's launcher process: ``tunedeck train --json`` with the node flags; its events as dicts."""

    def __init__(self, rank: int, flags: list[str], port: int, *extra: str, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "engine.cli", "train", *flags, "--json"]
        command += ["--nodes=2", f"--node-rank={rank}", f"--rendezvous=127.0.0.1:{port}", *extra]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []

    def stream(self) -> Iterator[dict[str, Any]]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))
                yield self.events[-1]

    def finish(self) -> list[dict[str, Any]]:
        for _ in self.stream():
            pass
        self.process.wait(timeout=HANG_S)
        return self.events

    def last(self, kind: str) -> dict[str, Any]:
        found = [e for e in self.events if e["kind"] == kind]
        assert found, (kind, self.events[-3:], self.stderr())
        return found[-1]

    def stderr(self) -> str:
        assert self.process.stderr is not None
        return self.process.stderr.read() if self.process.poll() is not None else ""


def two_nodes(
    flags: list[str], extra1: tuple[str, ...] = (), env1: dict[str, str] | None = None
) -> tuple[Node, Node]:
    port = free_port()
    return Node(0, flags, port), Node(1, flags, port, *extra1, env=env1)


def assert_gone(*nodes: Node) -> None:
    """Both launchers and every training process they started have exited."""
    processes = [psutil.Process(n.process.pid) for n in nodes if n.process.poll() is None]
    _, alive = psutil.wait_procs(processes, timeout=HANG_S)
    assert alive == []


def test_two_nodes_train_what_one_process_trains(tiny_model_dir: Path, varied_chat: Path, tmp_path: Path) -> None:
    one = finished(list(run(make_config(tiny_model_dir, varied_chat, tmp_path / "one", "run", max_steps=STEPS))))
    node0, node1 = two_nodes(base_flags(tiny_model_dir, varied_chat, tmp_path / "two"))
    events0, events1 = node0.finish(), node1.finish()
    assert node0.process.returncode == 0, node0.stderr()
    assert node1.process.returncode == 0, node1.stderr()
    done = node0.last("RunFinished")
    assert done["step"] == STEPS and done["run_dir"] == str(tmp_path / "two" / "run")
    assert_same_curve(curve(Path(done["run_dir"])), curve(Path(one.run_dir)))
    steps0 = [e["loss"] for e in events0 if e["kind"] == "StepMetrics"]
    assert [e["loss"] for e in events1 if e["kind"] == "StepMetrics"] == steps0  # node 1 follows the same run
    assert node1.last("RunFinished")["run_dir"] == f"node 0:{done['run_dir']}"
    links = [e["message"] for e in events0 if e["kind"] == "Notice" and "gloo over" in e["message"]]
    assert links and "node 0: gloo over lo" in links[0] and "node 1: gloo over lo" in links[0]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["run"]  # node 1 wrote nothing beside node 0
    assert_gone(node0, node1)


def test_a_node_with_other_rows_is_refused_on_both(tiny_model_dir: Path, varied_chat: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in varied_chat.read_text().splitlines()]
    rows[7]["messages"][1]["content"] = "a different answer"
    other = write_jsonl(tmp_path / "other" / "chat.jsonl", rows)
    flags = base_flags(tiny_model_dir, varied_chat, tmp_path / "out")
    node0, node1 = two_nodes(flags, extra1=(f"--data={other}",))
    node0.finish(), node1.finish()
    failures = [node0.last("RunFailed"), node1.last("RunFailed")]
    assert failures[0]["message"] == failures[1]["message"]
    assert failures[0]["message"].startswith("the nodes differ: the dataset's rows (fingerprint ")
    assert "base model" not in failures[0]["message"] and "setting" not in failures[0]["message"]
    assert node0.process.returncode == node1.process.returncode == 1
    assert not any(e["kind"] == "StepMetrics" for e in node0.events + node1.events)
    assert_gone(node0, node1)


def test_same_rows_in_another_order_of_keys_agree(tmp_path: Path) -> None:
    from engine.distributed.preflight import dataset_fingerprint

    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}])
    b = tmp_path / "b.jsonl"
    b.write_bytes(b'{"completion": "c", "prompt": "p"}\r\n{"completion": "d", "prompt": "q"}\r\n')
    c = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c"}])
    assert dataset_fingerprint(str(a)) == dataset_fingerprint(str(b)) != dataset_fingerprint(str(c))


def test_a_wrong_rendezvous_fails_within_its_timeout_with_a_hint(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path
) -> None:
    port = free_port()  # nobody listens there: node 0 was never started
    node1 = Node(1, base_flags(tiny_model_dir, varied_chat, tmp_path), port, "--rendezvous-timeout=5")
    started = time.monotonic()
    node1.finish()
    elapsed = time.monotonic() - started
    failed = node1.last("RunFailed")
    assert failed["message"] == f"the nodes did not meet at 127.0.0.1:{port} within 5 s (this is node 1 of 2)"
    assert f"TCP port {port}" in failed["hint"] and "firewall" in failed["hint"]
    assert elapsed < 5 + 15 + 30  # the timeout, the launcher's grace, and the start of Python and torch
    assert_gone(node1)


def kill_tree(pid: int) -> None:
    """A computer switched off: its launcher, torchrun and its ranks end at once, with no word to anyone."""
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue


def test_a_lost_node_stops_the_other_and_the_run_resumes_on_one_machine(
    tiny_model_dir: Path, varied_chat: Path, tmp_path: Path
) -> None:
    reference = finished(list(run(make_config(tiny_model_dir, varied_chat, tmp_path / "one", "run", max_steps=STEPS))))
    flags = [*base_flags(tiny_model_dir, varied_chat, tmp_path / "two"), f"--node-timeout={NODE_TIMEOUT_S}"]
    node0, node1 = two_nodes(flags, env1={FAULT_ENV: "1:5"})  # node 1's rank freezes-by-dying at step 5
    node1.finish()
    lost = time.monotonic()
    node0.finish()
    stopped_after = time.monotonic() - lost
    failed = node0.last("RunFailed")
    assert "node 1" in failed["message"], failed
    assert stopped_after < NODE_TIMEOUT_S + 30
    run_dir = tmp_path / "two" / "run"
    assert (run_dir / "checkpoints" / "step-000004").is_dir()
    assert_gone(node0, node1)

    resumed = finished(list(run(RunConfig(), resume=run_dir)))  # one machine: the resume keeps nodes=1
    assert resumed.step == STEPS
    assert_same_curve(curve(run_dir), curve(Path(reference.run_dir)))
    shutil.rmtree(run_dir)
