"""Each computer's figures in a run over two: they reach node 0 after every step and name the slower node.

Two launcher processes on this machine play the two computers (tests/test_two_nodes.py's harness); node 1 hands over
its gradients late (``TUNEDECK_SLOW_RANK``), as a slower computer would. Node 0's events then feed the terminal's
per-node line and the Run page's table of computers.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import test_two_nodes as harness
from app_fixtures import no_dangling_qthreads  # noqa: F401
from test_two_nodes import Network, base_flags, two_nodes

from engine.cli.progress import ProgressPrinter
from engine.config import RunConfig
from engine.distributed.launch import event_from_dict
from engine.distributed.node_figures import node_devices, node_figures
from engine.events import NodeFigures, StepMetrics
from engine.run.busy import SLOW_ENV

chat = harness.chat
network = harness.network
"""The harness's fixtures: the conversations and the two nodes' network (namespaces where the system allows)."""
STEPS = 4
DELAY_S = 0.8
"""How late node 1 hands over each gradient bucket: far above a tiny model's step on this machine's CPU."""


def test_each_nodes_figures_reach_node_0_and_name_the_slower_one(
    tiny_model_dir: Path, chat: Path, network: Network, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtbot: Any
) -> None:
    monkeypatch.setenv(SLOW_ENV, f"1:{DELAY_S}")  # global rank 1: node 1's only process
    node0, node1 = two_nodes(base_flags(tiny_model_dir, chat, tmp_path / "two", steps=STEPS), network)
    events0, events1 = node0.finish(), node1.finish()
    assert node0.process.returncode == 0 and node1.process.returncode == 0, node0.stderr() + node1.stderr()
    steps = {e["step"]: e for e in events0 if e["kind"] == "StepMetrics"}
    figures = [e for e in events0 if e["kind"] == "NodeFigures"]
    assert [f["step"] for f in figures] == list(range(1, STEPS + 1))
    for f in figures:
        assert len(f["devices"]) == 2 and all(device.startswith("CPU") for device in f["devices"])
        assert f["slowest"] == 1 and f["slower_by_s"] > DELAY_S / 2, f
        assert all(memory > 0 for memory in f["memory_bytes"])
        # node 0 ended the step with node 1 (its wall time holds the wait) but its wait is not counted as work
        assert f["step_time_s"][0] < steps[f["step"]]["step_time_s"] - DELAY_S / 2, (f, steps[f["step"]])
    assert [e for e in events1 if e["kind"] == "NodeFigures"] == figures  # node 1's terminal follows the same figures
    _shown_in_the_terminal(events0)
    _shown_on_the_run_page(events0, qtbot, tmp_path / "window.ini")


def _shown_in_the_terminal(events: list[dict[str, Any]]) -> None:
    out = io.StringIO()
    printer = ProgressPrinter(out)
    for raw in events:
        printer.handle(event_from_dict(raw))
    lines = [line.strip() for line in out.getvalue().splitlines() if " s/step, " in line]
    assert len(lines) == 1 and lines[0].startswith("step 1: node 0: CPU"), out.getvalue()  # the first step only
    assert "node 1 is slower:" in lines[0]


def _shown_on_the_run_page(events: list[dict[str, Any]], qtbot: Any, settings_file: Path) -> None:
    from test_app_window import open_window

    panel = open_window(qtbot, settings_file).run_panel
    table = panel.nodes
    assert table.isHidden()  # nothing to show before a run over several computers
    for raw in events:
        panel.on_event(event_from_dict(raw))
    last = event_from_dict([raw for raw in events if raw["kind"] == "NodeFigures"][-1])
    assert isinstance(last, NodeFigures)
    assert not table.isHidden() and table.table.rowCount() == 2
    for node in range(2):
        row = [table.table.item(node, column).text() for column in range(4)]
        assert row[0].startswith(str(node)) and row[1] == last.devices[node]
        assert row[2] == f"{last.step_time_s[node]:.2f} s"
        assert row[3] == f"{last.memory_bytes[node] / 2**30:.2f} GiB"
    assert table.slower.text().startswith(f"Step {STEPS}: Node 1 is slower: {last.slower_by_s:.2f} s more a step")
    panel._reset_view(RunConfig())  # the next run starts with no table until its own figures come
    assert table.isHidden() and table.table.rowCount() == 0


def _step(busy: list[float], memory: list[int]) -> StepMetrics:
    return StepMetrics(3, 10, 0.1, 1.0, 1e-3, 0.5, 100, 80, max(busy), 100.0, max(memory), memory, rank_busy_s=busy)


@pytest.mark.parametrize(
    ("busy", "memory", "node_of_rank", "times", "peaks", "slowest"),
    [
        ([0.2, 0.5], [10, 30], (0, 1), [0.2, 0.5], [10, 30], 1),
        ([0.4, 0.1, 0.3], [50, 20, 40], (0, 0, 1), [0.4, 0.3], [50, 40], 0),  # a node's slowest GPU sets its pace
        ([0.1, 0.2, 0.6], [5, 6, 7], (0, 1, 1), [0.1, 0.6], [5, 7], 1),
    ],
)
def test_rank_figures_regroup_by_node(
    busy: list[float],
    memory: list[int],
    node_of_rank: tuple[int, ...],
    times: list[float],
    peaks: list[int],
    slowest: int,
) -> None:
    devices = node_devices(["GPU A"] * len(node_of_rank), node_of_rank)
    figures = node_figures(_step(busy, memory), node_of_rank, devices)
    assert figures is not None
    assert (figures.step_time_s, figures.memory_bytes, figures.slowest) == (times, peaks, slowest)
    assert figures.slower_by_s == pytest.approx(max(times) - min(times))
    per_node = [node_of_rank.count(node) for node in range(2)]
    assert devices == ["GPU A" if n == 1 else f"{n} × GPU A" for n in per_node]


def test_a_step_without_rank_figures_has_no_node_figures() -> None:
    step = StepMetrics(1, 10, 0.1, 1.0, 1e-3, 0.5, 100, 80, 0.2, 500.0, 10)
    assert node_figures(step, (0, 1), ["CPU", "CPU"]) is None
