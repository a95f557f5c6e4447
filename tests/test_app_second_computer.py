"""The "Train with a second computer" panel: the run it makes, the other computer's command, and the check."""

from __future__ import annotations

import socket
from typing import Any

from engine.config import RunConfig


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_ticked_the_run_is_node_0_of_two_and_the_command_joins_it(qtbot: Any) -> None:
    from app.widgets.second_computer import SecondComputer

    panel = SecondComputer()
    qtbot.addWidget(panel)
    config = RunConfig.from_dict({"model": {"name": "./my model"}, "data": {"path": "chats.jsonl"}})
    assert panel.apply(config) == config  # not ticked: one computer
    panel.setChecked(True)
    panel.port.setValue(29411)
    two = panel.apply(config).training
    assert (two.nodes, two.node_rank, two.rendezvous) == (2, 0, panel.rendezvous())
    assert panel.rendezvous().endswith(":29411")
    panel.show_command(config)
    assert panel.command.text() == (
        f"tunedeck train --model './my model' --data chats.jsonl --nodes 2 --node-rank 1 --rendezvous {two.rendezvous}"
    )


def test_the_check_says_when_the_other_computer_reaches_this_one(qtbot: Any) -> None:
    from app.widgets.second_computer import SecondComputer

    panel = SecondComputer()
    qtbot.addWidget(panel)
    panel.setChecked(True)
    panel.port.setValue(free_port())
    panel.check()
    assert panel.server.isListening()
    with qtbot.waitSignal(panel.checked_peer) as reached:
        knock = socket.create_connection(("127.0.0.1", panel.port.value()))  # the other computer's first try
    knock.close()
    assert reached.args == ["127.0.0.1"]
    assert "reaches this one" in panel.result.text() and not panel.server.isListening()


def test_a_taken_port_is_said_at_once(qtbot: Any) -> None:
    from app.widgets.second_computer import SecondComputer

    panel = SecondComputer()
    qtbot.addWidget(panel)
    with socket.create_server(("0.0.0.0", 0)) as taken:
        panel.port.setValue(taken.getsockname()[1])
        panel.check()
    assert "is taken" in panel.result.text() and not panel.server.isListening()
