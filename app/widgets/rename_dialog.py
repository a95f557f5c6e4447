"""The dialog that renames a run: its name field says, as it is typed, why a name is refused, and OK waits until
the name is one plain folder name (engine.config.run_name_problem, the rule ``tunedeck runs rename`` follows)."""

from __future__ import annotations

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QLineEdit, QVBoxLayout, QWidget

from engine.config import run_name_problem

ERROR_COLOUR = "#b00020"


class RenameDialog(QDialog):
    """Asks for a run's new name; ``name()`` is the accepted text, without surrounding spaces."""

    def __init__(self, current: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Rename run")
        self.field = QLineEdit(current)
        self.field.setMinimumWidth(320)
        self.problem = QLabel("")
        self.problem.setWordWrap(True)
        self.problem.setStyleSheet(f"color:{ERROR_COLOUR}")
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("New name:"))
        layout.addWidget(self.field)
        layout.addWidget(self.problem)
        layout.addWidget(self.buttons)
        self.field.textChanged.connect(self._check)
        self._check(current)

    def name(self) -> str:
        return self.field.text().strip()

    def _check(self, text: str) -> None:
        reason = run_name_problem(text.strip())
        self.problem.setText(f"The name {reason}." if reason else "")
        self.problem.setVisible(reason is not None)
        self.field.setStyleSheet(f"border: 1px solid {ERROR_COLOUR}" if reason else "")
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(reason is None)

    def accept(self) -> None:
        if run_name_problem(self.name()) is None:  # Enter in the field accepts too: the same rule holds
            super().accept()
