"""Train with a second computer: this machine's address, the command for the other one, and a check before Start.

Ticked, the run becomes node 0 of two (``--nodes 2 --node-rank 0 --rendezvous ADDRESS:PORT``): this computer keeps
the run folder, the other joins with the command shown. "Check" listens on the port until the other computer's
command reaches it (its first attempt to join), which proves the address, the port and the firewall before Start;
the other computer keeps trying until this one starts the run.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import QTimer, Signal
from PySide6.QtNetwork import QHostAddress, QTcpServer
from PySide6.QtWidgets import QComboBox, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout

from engine.config import RunConfig
from engine.distributed.nodes import join_command, this_machine_addresses

DEFAULT_PORT = 29400
CHECK_S = 120


class SecondComputer(QGroupBox):
    """A checkable box: address and port of this computer, the other computer's command, and the check."""

    checked_peer = Signal(str)
    """The other computer's address, once its command reached this one."""

    def __init__(self) -> None:
        super().__init__("Train with a second computer")
        self.setCheckable(True)
        self.setChecked(False)
        self.address = QComboBox()
        for interface, address in this_machine_addresses():
            self.address.addItem(f"{address} ({interface})", address)
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setValue(DEFAULT_PORT)
        self.command = QLineEdit()
        self.command.setReadOnly(True)
        self.check_button = QPushButton("Check the other computer")
        self.result = QLabel("Run the command on the other computer, then check that it reaches this one.")
        self.result.setWordWrap(True)
        self.server = QTcpServer(self)
        self.server.newConnection.connect(self._reached)
        self.deadline = QTimer(self)
        self.deadline.setSingleShot(True)
        self.deadline.timeout.connect(self._not_reached)
        self.check_button.clicked.connect(self.check)
        self._layout()

    def _layout(self) -> None:
        where = QHBoxLayout()
        where.addWidget(QLabel("This computer:"))
        where.addWidget(self.address, 1)
        where.addWidget(QLabel("port"))
        where.addWidget(self.port)
        layout = QVBoxLayout(self)
        layout.addLayout(where)
        layout.addWidget(QLabel("On the other computer, with the same model and data:"))
        layout.addWidget(self.command)
        layout.addWidget(self.check_button)
        layout.addWidget(self.result)

    def rendezvous(self) -> str:
        return f"{self.address.currentData() or '127.0.0.1'}:{self.port.value()}"

    def show_command(self, config: RunConfig) -> None:
        """The other computer's command for the run the form describes now."""
        address = str(self.address.currentData() or "127.0.0.1")
        model, data = config.model.name, config.data.path or "DATA.jsonl"
        self.command.setText(join_command(model, data, address, self.port.value(), config.training.device))

    def apply(self, config: RunConfig) -> RunConfig:
        """The config as node 0 of two when ticked; unchanged otherwise."""
        if not self.isChecked():
            return config
        training = dataclasses.replace(config.training, nodes=2, node_rank=0, rendezvous=self.rendezvous())
        return dataclasses.replace(config, training=training)

    def check(self) -> None:
        """Listen on the port until the other computer's command knocks (it retries until the run starts here)."""
        self.stop_check()
        if not self.server.listen(QHostAddress.SpecialAddress.Any, self.port.value()):
            self.result.setText(f"Port {self.port.value()} is taken on this computer: choose another.")
            return
        self.result.setText(f"Waiting up to {CHECK_S} s for the other computer on port {self.port.value()}…")
        self.deadline.start(CHECK_S * 1000)

    def stop_check(self) -> None:
        self.deadline.stop()
        if self.server.isListening():
            self.server.close()

    def _reached(self) -> None:
        connection = self.server.nextPendingConnection()
        peer = connection.peerAddress().toString().removeprefix("::ffff:")
        connection.abort()
        self.stop_check()
        self.result.setText(f"The other computer ({peer}) reaches this one: press Start to train on both.")
        self.checked_peer.emit(peer)

    def _not_reached(self) -> None:
        self.stop_check()
        self.result.setText(
            f"Nothing reached port {self.port.value()}: is the command running on the other computer, is "
            f"{self.address.currentData()} this computer's address on the network you share, and does this "
            "computer's firewall let the port in?"
        )
