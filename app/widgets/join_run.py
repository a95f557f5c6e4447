"""Join a run another computer starts: the second computer's side of "Train with a second computer".

The user types the address and port the other computer's app shows, and presses Join: this computer then runs the
very command that app shows for it (``tunedeck train --model M --data D --nodes 2 --node-rank 1 --rendezvous
ADDRESS:PORT``, parsed by the command line's own parser), with the model and data chosen here. Every other setting
is the other computer's (engine.distributed.joined); this one follows the run and keeps no run folder of its own.
"""

from __future__ import annotations

import shlex

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QVBoxLayout, QWidget

from engine.config import RunConfig
from engine.distributed.nodes import join_command
from engine.errors import ConfigError


class JoinRun(QGroupBox):
    """A checkable box: the other computer's address and port, and Join."""

    join_requested = Signal()

    def __init__(self) -> None:
        super().__init__("Join a run on another computer")
        self.setCheckable(True)
        self.setChecked(False)
        self.address = QLineEdit()
        self.address.setPlaceholderText("192.168.1.20:29400")
        self.address.setToolTip("The address and port that the other computer's app shows under 'This computer'")
        self.join_button = QPushButton("Join")
        self.join_button.clicked.connect(self.join_requested)
        self.address.returnPressed.connect(self.join_requested)
        where = QHBoxLayout()
        where.addWidget(QLabel("The other computer:"))
        where.addWidget(self.address, 1)
        where.addWidget(self.join_button)
        note = QLabel(
            "This computer trains its share with the model and data chosen here (the same files as the other "
            "computer's) and that computer's settings; the run folder stays there."
        )
        note.setWordWrap(True)
        inside = QWidget()  # shown only when ticked: most runs use one computer, and the page has little room
        column = QVBoxLayout(inside)
        column.setContentsMargins(0, 0, 0, 0)
        column.addLayout(where)
        column.addWidget(note)
        QVBoxLayout(self).addWidget(inside)
        inside.setVisible(False)
        self.toggled.connect(inside.setVisible)

    def rendezvous(self) -> str:
        """The typed ``HOST:PORT``; a ConfigError with what to type when it is not one."""
        text = self.address.text().strip()
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"'{text}' is not an address and port" if text else "no address to join",
                hint="type the address and port the other computer's app shows, such as 192.168.1.20:29400",
            )
        return f"{host}:{port}"

    def command(self, config: RunConfig) -> str:
        """The command this computer runs to join: the one the other computer's app shows for it."""
        host, _, port = self.rendezvous().rpartition(":")
        if not config.data.path:
            raise ConfigError("no data chosen to join with", hint="choose this computer's copy of the run's data file")
        return join_command(config.model.name, config.data.path, host, int(port), config.training.device)

    def apply(self, config: RunConfig) -> RunConfig:
        """The run that :meth:`command` starts, built by the command line's own parser."""
        from engine.cli.train import train_config, train_parser

        words = shlex.split(self.command(config))
        return train_config(train_parser().parse_args(words[2:]))  # after "tunedeck train"
