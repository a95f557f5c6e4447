"""Two computers as one run, played by two launcher processes on this machine (gloo, CPU, a rendezvous on a free port).

Each node runs the flags a user types on each computer (``--nodes 2 --node-rank R --rendezvous HOST:PORT``). Where
the system allows (root, network namespaces), each node lives in a network namespace of its own, joined to the other
by a virtual Ethernet pair, so addresses, interfaces and a pulled cable are real; elsewhere both use 127.0.0.1. The
run must train exactly what one process trains on the same global batch, stop both nodes when one goes, resume on
one machine or on two along the same curve, refuse nodes that would train different things, and fail soon with a
hint when nobody answers at the rendezvous.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from hang import HANG_S
from helpers import write_jsonl
from test_distributed import assert_same_curve, curve, finished, make_config

from engine.config import RunConfig
from engine.train import run

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
NODE_TIMEOUT_S = 3.0
"""The lost-node bound the fault tests run with: short, so that a test waits seconds, not the default 30."""
LAUNCHER = """
import json, sys
from engine.cli.train import _with_stop_on_interrupt, train_config, train_parser
from engine.train import run

config = train_config(train_parser().parse_args(sys.argv[1:]))

def job(control):
    for event in run(config, control=control, resume=config_resume):
        print(json.dumps(event.to_dict()), flush=True)
    return 0

config_resume = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--resume=")), None)
sys.exit(_with_stop_on_interrupt(job))
"""
"""``tunedeck train --json`` without the before/after report it measures at the end (minutes on two busy cores)."""


@dataclass(frozen=True)
class Network:
    """Where each node runs: a command prefix (a network namespace, or none) and node 0's address."""

    prefixes: tuple[list[str], list[str]]
    address: str
    interfaces: tuple[str, str]
    names: tuple[str, ...] = ()

    def cut(self) -> None:
        """Pull node 1's cable: its end of the link goes down, and no packet passes either way."""
        subprocess.run([*self.prefixes[1], "ip", "link", "set", self.interfaces[1], "down"], check=True)


def _namespaces() -> Network | None:
    tag = f"td{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    interfaces = (f"{tag}va", f"{tag}vb")
    peer = ["peer", interfaces[1], "netns", names[1]]
    commands = [
        ["ip", "netns", "add", names[0]],
        ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", interfaces[0], "netns", names[0], "type", "veth", *peer],
        ["ip", "-n", names[0], "addr", "add", "10.77.0.1/24", "dev", interfaces[0]],
        ["ip", "-n", names[1], "addr", "add", "10.77.0.2/24", "dev", interfaces[1]],
        *[["ip", "-n", n, "link", "set", dev, "up"] for n, dev in zip(names, interfaces, strict=True)],
        *[["ip", "-n", n, "link", "set", "lo", "up"] for n in names],
    ]
    for command in commands:
        if subprocess.run(command, capture_output=True).returncode != 0:
            _remove(names)
            return None
    prefixes = (["ip", "netns", "exec", names[0]], ["ip", "netns", "exec", names[1]])
    return Network(prefixes, "10.77.0.1", interfaces, names)


def _remove(names: tuple[str, ...]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@pytest.fixture
def network() -> Iterator[Network]:
    """Two network namespaces joined by a veth pair where this system lets us make them; else the loopback."""
    made = _namespaces() if sys.platform == "linux" and os.geteuid() == 0 else None
    yield made or Network(([], []), "127.0.0.1", ("lo", "lo"))
    if made:
        _remove(made.names)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversations of different lengths (the rows of tests/test_distributed.py's ``varied_chat``)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"say {i}" + " ok" * (i % 3)},
                {"role": "assistant", "content": f"number {i}" + " yes" * (i % 4)},
            ]
        }
        for i in range(30)
    ]
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, chat: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's run of the same rows and settings: the curve every two-node run must draw."""
    out = tmp_path_factory.mktemp("one")
    return Path(finished(list(run(make_config(tiny_model_dir, chat, out, "run", max_steps=STEPS)))).run_dir)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def base_flags(model: Path, data: Path, out: Path, steps: int = STEPS) -> list[str]:
    """The settings of ``make_config`` (tests/test_distributed.py) as a user types them."""
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
    """One computer's launcher process, in its network namespace; its events as dicts."""

    def __init__(self, rank: int, flags: list[str], network: Network, port: int, *extra: str) -> None:
        command = [*network.prefixes[rank], sys.executable, "-c", LAUNCHER, *flags]
        command += ["--nodes=2", f"--node-rank={rank}", f"--rendezvous={network.address}:{port}", *extra]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
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

    def until_step(self, step: int) -> None:
        for event in self.stream():
            if event["kind"] == "StepMetrics" and event["step"] >= step:
                return
        raise AssertionError(f"the run ended before step {step}: {self.events[-3:]} {self.stderr()}")

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
        return self.process.stderr.read()[-4000:] if self.process.poll() is not None else ""


def two_nodes(flags: list[str], network: Network, flags1: list[str] | None = None) -> tuple[Node, Node]:
    port = free_port()
    return Node(0, flags, network, port), Node(1, flags if flags1 is None else flags1, network, port)


def assert_gone(*nodes: Node) -> None:
    """Every launcher and every training process they started has exited."""
    mine = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(mine, timeout=HANG_S)
    assert alive == [] and all(n.process.poll() is not None for n in nodes)


def steps_of(events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in events if e["kind"] == "StepMetrics"]


def test_two_nodes_train_what_one_process_trains(
    tiny_model_dir: Path, chat: Path, reference: Path, network: Network, tmp_path: Path
) -> None:
    node0, node1 = two_nodes(base_flags(tiny_model_dir, chat, tmp_path / "two"), network)
    events0, events1 = node0.finish(), node1.finish()
    assert node0.process.returncode == 0, node0.stderr()
    assert node1.process.returncode == 0, node1.stderr()
    done = node0.last("RunFinished")
    assert done["step"] == STEPS and done["run_dir"] == str(tmp_path / "two" / "run")
    assert_same_curve(curve(Path(done["run_dir"])), curve(reference))
    assert steps_of(events1) == steps_of(events0)  # node 1 follows the same run
    assert node1.last("RunFinished")["run_dir"] == f"node 0:{done['run_dir']}"
    links = next(e["message"] for e in events0 if e["kind"] == "Notice" and "gloo over" in e["message"])
    assert f"node 0: gloo over {network.interfaces[0]} " in links, links
    assert f"node 1: gloo over {network.interfaces[1]} " in links, links
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["run"]  # node 1 wrote nothing beside node 0
    assert_gone(node0, node1)


def test_a_node_with_other_rows_is_refused_on_both(
    tiny_model_dir: Path, chat: Path, network: Network, tmp_path: Path
) -> None:
    rows = [json.loads(line) for line in chat.read_text().splitlines()]
    rows[7]["messages"][1]["content"] = "a different answer"
    other = write_jsonl(tmp_path / "other.jsonl", rows)
    flags = base_flags(tiny_model_dir, chat, tmp_path / "out")
    node0, node1 = two_nodes(flags, network, [*flags, f"--data={other}"])
    node0.finish(), node1.finish()
    failures = [node0.last("RunFailed"), node1.last("RunFailed")]
    assert failures[0]["message"] == failures[1]["message"]
    assert failures[0]["message"].startswith("the nodes differ: the dataset's rows (fingerprint "), failures
    assert ";" not in failures[0]["message"]  # the one difference, nothing else
    assert node0.process.returncode == node1.process.returncode == 0  # the launcher reported the failure
    assert steps_of(node0.events + node1.events) == []
    assert_gone(node0, node1)


def test_same_rows_in_another_spelling_agree(tmp_path: Path) -> None:
    from engine.distributed.preflight import dataset_fingerprint

    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}])
    b = tmp_path / "b.jsonl"
    b.write_bytes(b'{"completion": "c", "prompt": "p"}\r\n{"completion": "d", "prompt": "q"}\r\n')
    c = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c"}])
    assert dataset_fingerprint(str(a)) == dataset_fingerprint(str(b)) != dataset_fingerprint(str(c))


def test_a_wrong_rendezvous_fails_within_its_timeout_with_a_hint(
    tiny_model_dir: Path, chat: Path, network: Network, tmp_path: Path
) -> None:
    port = free_port()  # node 0 was never started: nobody answers there
    started = time.monotonic()
    expires = "--rendezvous-timeout=5"  # not a hang bound: the wait that must run out
    node1 = Node(1, base_flags(tiny_model_dir, chat, tmp_path), network, port, expires)
    node1.finish()
    elapsed = time.monotonic() - started
    failed = node1.last("RunFailed")
    assert failed["message"] == f"the nodes did not meet at {network.address}:{port} within 5 s (this is node 1 of 2)"
    assert f"TCP port {port}" in failed["hint"] and "firewall" in failed["hint"]
    assert elapsed < 5 + 15 + 60  # the timeout, the launcher's grace, and starting Python and torch on busy cores
    assert_gone(node1)


def test_a_lost_node_stops_the_other_and_the_run_resumes_on_one_machine(
    tiny_model_dir: Path, chat: Path, reference: Path, network: Network, tmp_path: Path
) -> None:
    flags = [*base_flags(tiny_model_dir, chat, tmp_path), f"--node-timeout={NODE_TIMEOUT_S}"]
    node0, node1 = two_nodes(flags, network)
    node0.until_step(5)
    if network.names:
        network.cut()  # the cable: no connection closes, the packets just stop
    else:
        for process in [node1.process, *psutil.Process(node1.process.pid).children(recursive=True)]:
            process.kill()  # the computer switched off
    lost = time.monotonic()
    node0.finish()
    stopped_after = time.monotonic() - lost
    node1.finish()
    failed = node0.last("RunFailed")
    assert failed["message"].startswith("node 1 stopped answering for 3 s"), failed
    assert "--resume" in failed["hint"]
    assert stopped_after < NODE_TIMEOUT_S + 30, stopped_after  # the bound, and a busy machine's slack
    print(f"node 0 stopped {stopped_after:.1f} s after node 1 went ({'cable' if network.names else 'kill'})")
    if network.names:  # node 1 is alive and alone: it stops too, naming node 0
        assert node1.last("RunFailed")["message"].startswith("lost the connection to node 0"), node1.events[-1]
    run_dir = tmp_path / "run"
    assert list((run_dir / "checkpoints").glob("step-*"))
    assert_gone(node0, node1)

    resumed = finished(list(run(RunConfig(), resume=run_dir)))  # one machine: a resume runs where it is started
    assert resumed.step == STEPS
    assert_same_curve(curve(run_dir), curve(reference))


def test_ctrl_c_on_node_0_stops_both_and_two_nodes_resume(
    tiny_model_dir: Path, chat: Path, reference: Path, network: Network, tmp_path: Path
) -> None:
    flags = base_flags(tiny_model_dir, chat, tmp_path)
    node0, node1 = two_nodes(flags, network)
    node0.until_step(1)
    node0.process.send_signal(signal.SIGINT)
    node0.finish(), node1.finish()
    stopped = node0.last("RunFinished")
    assert stopped["cancelled"] and 1 <= stopped["step"] < STEPS, stopped
    assert node1.last("RunFinished")["step"] == stopped["step"]
    run_dir = Path(stopped["run_dir"])
    assert (run_dir / "checkpoints" / f"step-{stopped['step']:06d}").is_dir()
    assert_gone(node0, node1)

    node0, node1 = two_nodes([f"--resume={run_dir}"], network, flags)  # node 1 joins as it always does
    node0.finish(), node1.finish()
    assert node0.last("RunFinished")["step"] == STEPS, node0.stderr()
    assert steps_of(node1.events) == steps_of(node0.events)
    assert_same_curve(curve(run_dir), curve(reference))
    assert_gone(node0, node1)


@pytest.mark.parametrize(
    ("training", "problem"),
    [
        ({"nodes": 2}, "training.rendezvous: must be HOST:PORT"),
        ({"nodes": 2, "rendezvous": "10.0.0.1"}, "training.rendezvous: must be HOST:PORT"),
        ({"nodes": 2, "node_rank": 2, "rendezvous": "a:1"}, "training.node_rank: must be 0 to 1"),
        ({"nodes": 0}, "training.nodes: must be at least 1"),
        ({"nodes": 2, "rendezvous": "a:1", "node_timeout": 0}, "training.node_timeout: must be positive"),
    ],
)
def test_node_settings_are_checked(training: dict[str, object], problem: str) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=problem):
        RunConfig.from_dict({"training": training})


def test_torchrun_meets_the_other_nodes_at_the_rendezvous_hosted_by_node_0() -> None:
    from engine.distributed.launch import _visible
    from engine.distributed.nodes import rendezvous_args

    one = RunConfig().training
    assert rendezvous_args(one) == ["--standalone"]
    node1 = RunConfig.from_dict({"training": {"nodes": 2, "node_rank": 1, "rendezvous": "10.0.0.1:29400"}}).training
    args = rendezvous_args(node1, "10.0.0.2")
    assert "--rdzv-endpoint=10.0.0.1:29400" in args and "--rdzv-backend=c10d" in args
    conf = "--rdzv-conf=join_timeout=120,read_timeout=120,is_host=false"  # not a hang bound: an argument
    assert conf in args and "--local-addr=10.0.0.2" in args
    assert _visible([0], "1") == ["1"] and _visible([0, 1], None) == ["0", "1"]  # a node on the second GPU keeps it


def test_ctrl_c_on_node_1_stops_both_with_a_checkpoint(
    tiny_model_dir: Path, chat: Path, network: Network, tmp_path: Path
) -> None:
    node0, node1 = two_nodes(base_flags(tiny_model_dir, chat, tmp_path, steps=200), network)
    node1.until_step(1)
    node1.process.send_signal(signal.SIGINT)
    node0.finish(), node1.finish()
    stopped = node0.last("RunFinished")
    assert stopped["cancelled"] and stopped["step"] < 200 and node1.last("RunFinished")["step"] == stopped["step"]
    assert (Path(stopped["run_dir"]) / "checkpoints" / f"step-{stopped['step']:06d}").is_dir()
    assert_gone(node0, node1)


def test_a_setting_node_1_leaves_alone_takes_node_0s_and_one_it_sets_must_agree() -> None:
    from engine.distributed.preflight import check_identities, node_identity
    from engine.errors import ConfigError

    def identity(training: dict[str, object]) -> dict[str, object]:
        return node_identity(RunConfig.from_dict({"training": training}), link="")

    node0 = identity({"learning_rate": 1e-3, "max_steps": 20})
    check_identities([node0, identity({})], (0, 1))  # node 1 left them automatic: node 0's apply
    with pytest.raises(ConfigError) as caught:
        check_identities([node0, identity({"learning_rate": 2e-3})], (0, 1))
    wanted = "the nodes differ: setting training.learning_rate is 0.001 on node 0, 0.002 on node 1"
    assert caught.value.message == wanted


def test_a_node_that_cannot_read_its_data_stops_both_with_its_reason() -> None:
    from engine.distributed.preflight import check_identities, node_identity
    from engine.errors import ConfigError

    fine = node_identity(RunConfig(), link="")
    with pytest.raises(ConfigError, match=r"^node 1 cannot start: no such file or folder"):
        check_identities([fine, {"problem": "no such file or folder", "link": ""}], (0, 1))
