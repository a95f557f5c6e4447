"""The second computer's "Join a run": it runs the command the first computer's app shows for it, and trains.

The unit tests compare the run Join starts with the first computer's ready command; the end-to-end test starts node 0
as a user does on the command line (tests/test_two_nodes.py's harness, on 127.0.0.1) and joins it with the run the
Join box builds, iterated in this process as the app's worker does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_two_nodes as harness
from test_two_nodes import Network, Node, base_flags, free_port, steps_of

from engine.config import RunConfig
from engine.errors import ConfigError
from engine.events import RunFinished, StepMetrics
from engine.train import run

chat = harness.chat
"""The harness's conversations."""
STEPS = 3


def _join_box(qtbot: Any, address: str) -> Any:
    from app.widgets.join_run import JoinRun

    box = JoinRun()
    qtbot.addWidget(box)
    box.setChecked(True)
    box.address.setText(address)
    return box


def test_join_runs_the_command_the_other_computers_app_shows(qtbot: Any) -> None:
    from app.widgets.second_computer import SecondComputer

    config = RunConfig.from_dict({"model": {"name": "./my model"}, "data": {"path": "chats.jsonl"}})
    first = SecondComputer()
    qtbot.addWidget(first)
    first.setChecked(True)
    first.show_command(config)
    box = _join_box(qtbot, first.rendezvous())
    assert box.command(config) == first.command.text()
    joined = box.apply(config)
    assert (joined.training.nodes, joined.training.node_rank) == (2, 1)
    assert joined.training.rendezvous == first.rendezvous()
    assert (joined.model.name, joined.data.path) == ("./my model", "chats.jsonl")


@pytest.mark.parametrize(("address", "said"), [("", "no address"), ("10.0.0.2", "not an address"), ("h:99999", "not")])
def test_a_wrong_address_is_refused_with_what_to_type(qtbot: Any, address: str, said: str) -> None:
    box = _join_box(qtbot, address)
    with pytest.raises(ConfigError) as refused:
        box.apply(RunConfig.from_dict({"data": {"path": "chats.jsonl"}}))
    assert said in refused.value.message and "the other computer's app shows" in (refused.value.hint or "")


def test_the_joined_computer_trains_node_0s_run(tiny_model_dir: Path, chat: Path, tmp_path: Path, qtbot: Any) -> None:
    port = free_port()
    node0 = Node(
        0,
        base_flags(tiny_model_dir, chat, tmp_path / "two", steps=STEPS),
        Network(([], []), "127.0.0.1", ("lo", "lo")),
        port,
    )
    here = RunConfig.from_dict(
        {"model": {"name": str(tiny_model_dir)}, "data": {"path": str(chat)}, "training": {"device": "cpu"},
         "output": {"dir": str(tmp_path / "joined")}}
    )  # fmt: skip
    config = _join_box(qtbot, f"127.0.0.1:{port}").apply(here)
    events = list(run(config))
    events0 = node0.finish()
    assert node0.process.returncode == 0, node0.stderr()
    done = events[-1]
    assert isinstance(done, RunFinished), events[-3:]
    assert done.run_dir.startswith("node 0:") and done.step == STEPS
    mine = [(e.step, e.loss) for e in events if isinstance(e, StepMetrics)]
    assert mine == steps_of(events0)  # node 0's settings (its learning rate, its batch), node 0's curve


def test_the_run_page_starts_a_run_with_a_second_computer_or_joins_one_never_both(qtbot: Any, tmp_path: Path) -> None:
    from test_app_window import open_window

    panel = open_window(qtbot, tmp_path / "window.ini").run_panel
    panel.second_computer.setChecked(True)
    panel.join_run.setChecked(True)
    assert not panel.second_computer.isChecked()
    panel.second_computer.setChecked(True)
    assert not panel.join_run.isChecked()
    panel.join_run.setChecked(True)
    panel.build_config = lambda: RunConfig.from_dict({"data": {"path": "chats.jsonl"}})  # the form, filled in
    panel.join_run.address.setText("the other computer")
    panel.join_run.join_button.click()
    assert not panel.controller.active
    assert panel.error.text().startswith("&#x27;the other computer&#x27; is not an address and port"), (
        panel.error.text()
    )


def test_the_table_marks_the_computer_the_app_runs_on(qtbot: Any) -> None:
    from app.widgets.node_table import NodeTable
    from engine.events import NodeFigures

    table = NodeTable()
    qtbot.addWidget(table)
    table.this_node = 1  # the app joined another computer's run
    table.show_figures(NodeFigures(2, ["CPU", "CPU"], [0.1, 0.2], [1, 2], 1, 0.1))
    assert [table.table.item(row, 0).text() for row in range(2)] == ["0", "1 (this computer)"]
