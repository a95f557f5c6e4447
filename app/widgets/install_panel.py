"""After a GGUF export: install it into Ollama or LM Studio with one click, and compare one answer.

Each button runs ``engine.export.install.install_export`` in a background thread (an upload and the runtime's
first answer can take a while). The panel then shows what was done, what is left to run (selectable, to copy),
and, when the runtime answered, its answer beside TuneDeck's own answer to the same question.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import ErrorInfo, TaskRunner
from app.theme import ERROR_COLOR
from app.widgets.fitted_label import FittedLabel

RUNTIMES = {"ollama": "Install in Ollama", "lmstudio": "Install in LM Studio"}


class InstallPanel(QGroupBox):
    """Install buttons for one GGUF export, the question to ask, and the two answers side by side."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Use it in Ollama or LM Studio", parent)
        from engine.export.install import DEFAULT_QUESTION

        self.tasks = TaskRunner(self)
        self.run_folder: Path | None = None
        self.export_folder: Path | None = None
        self.adapter = "best"
        """Which of the run's adapters the export was made from (TuneDeck answers with the same)."""
        self.report: Any = None  # the last InstallReport (tests read it)
        self.buttons = {runtime: QPushButton(text) for runtime, text in RUNTIMES.items()}
        self.question = QLineEdit(DEFAULT_QUESTION)
        self.status = FittedLabel("", lines=0)  # its commands hold long paths: they wrap, never widen the dialog
        self.runtime_label = QLabel("")
        self.tunedeck_label = QLabel("<b>TuneDeck's answer</b>")
        self.runtime_answer = QLabel("")
        self.tunedeck_answer = QLabel("")
        self._build()
        for runtime, button in self.buttons.items():
            button.clicked.connect(lambda _=False, r=runtime: self.install(r))
        self.set_export(None, None)

    def _build(self) -> None:
        buttons = QHBoxLayout()
        for button in self.buttons.values():
            buttons.addWidget(button)
        buttons.addStretch(1)
        question = QHBoxLayout()
        question.addWidget(QLabel("Question to check with:"))
        question.addWidget(self.question, 1)
        answers = QGridLayout()
        answers.addWidget(self.runtime_label, 0, 0)
        answers.addWidget(self.tunedeck_label, 0, 1)
        answers.addWidget(self.runtime_answer, 1, 0)
        answers.addWidget(self.tunedeck_answer, 1, 1)
        for column in (0, 1):
            answers.setColumnStretch(column, 1)
        for label in (self.status, self.runtime_answer, self.tunedeck_answer):
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        for label in (self.runtime_answer, self.tunedeck_answer):
            label.setTextFormat(Qt.TextFormat.PlainText)  # a model's answer is text, never markup
        layout = QVBoxLayout(self)
        layout.addLayout(buttons)
        layout.addLayout(question)
        layout.addWidget(self.status)
        layout.addLayout(answers)

    def set_export(self, run_folder: Path | None, export_folder: Path | None, adapter: str = "best") -> None:
        """The GGUF export to install (None: nothing to install yet, the buttons wait), made from the run's
        ``adapter`` (best or last: TuneDeck's own answer uses the same)."""
        if run_folder is not None and run_folder != self.run_folder:  # a run's own held-out question, read aside
            self._ask_from(run_folder)
        self.run_folder, self.export_folder, self.adapter = run_folder, export_folder, adapter
        ready = export_folder is not None and (export_folder / "Modelfile").exists()
        if export_folder is None:  # nothing exported (or another choice since): no word of an earlier install
            self.status.setText("")
            self._show_answers(None)
        for button in self.buttons.values():
            button.setEnabled(ready)
            button.setToolTip("" if ready else "Export a GGUF file first")

    def _ask_from(self, run_folder: Path) -> None:
        """Put one of the run's held-out questions in the question box (the box keeps what the user typed)."""
        from engine.export.install import DEFAULT_QUESTION, held_out_question

        def put(question: Any) -> None:
            if question and self.run_folder == run_folder and self.question.text() in ("", DEFAULT_QUESTION):
                self.question.setText(str(question))

        self.tasks.start(lambda: held_out_question(run_folder), put, lambda _error: None)

    def busy(self) -> bool:
        return self.tasks.busy()

    def install(self, runtime: str) -> None:
        if self.run_folder is None or self.export_folder is None or self.busy():
            return
        from engine.export.install import install_export

        run, folder, question = self.run_folder, self.export_folder, self.question.text().strip()
        adapter = self.adapter
        for button in self.buttons.values():
            button.setEnabled(False)
        self.report = None
        self.status.setStyleSheet("")
        self.status.setText(f"Installing into {RUNTIMES[runtime].removeprefix('Install in ')}…")
        self._show_answers(None)

        def job() -> Any:
            asked = {"question": question} if question else {}
            return install_export(run, folder, runtime, adapter=adapter, **asked)

        self.tasks.start(job, self._installed, self._failed)

    def _installed(self, report: Any) -> None:
        self.report = report
        self.set_export(self.run_folder, self.export_folder, self.adapter)
        lines = [html.escape(f"{report.runtime}: {sentence}", quote=False) for sentence in report.done]
        if report.problem:
            lines.append(html.escape(f"{report.runtime}: {report.problem}", quote=False))
        if report.todo:
            lines.append("To finish:" if not report.installed else "Then:")
            lines += [f"<code>{html.escape(command, quote=False)}</code>" for command in report.todo]
        self.status.setText("<br>".join(lines))
        self._show_answers(report)

    def _show_answers(self, report: Any) -> None:
        asked = report is not None and report.answer is not None
        self.runtime_label.setText(f"<b>{html.escape(report.runtime)}'s answer</b>" if asked else "")
        self.runtime_answer.setText(report.answer if asked else "")
        self.tunedeck_answer.setText((report.tunedeck_answer or "") if asked else "")
        for label in (self.runtime_label, self.tunedeck_label, self.runtime_answer, self.tunedeck_answer):
            label.setVisible(asked)

    def _failed(self, error: ErrorInfo) -> None:
        self.set_export(self.run_folder, self.export_folder, self.adapter)
        hint = f" What to do: {error.hint}" if error.hint else ""
        self.status.setStyleSheet(f"color:{ERROR_COLOR}")
        self.status.setText(html.escape(f"The install failed: {error.message}.{hint}"))
