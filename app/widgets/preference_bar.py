"""Under the Chat page's two answers: keep the better one, or edit one into the answer wanted, as a preference pair.

The pairs go to the loaded run's base model's store (engine.data.preferences), which counts them, exports them as
DPO data and builds the DPO run that trains on them; this bar only wires buttons to it. Each side has "This one is
better" (that answer chosen, the other rejected) and "Edit into the chosen answer…": an editor prefilled with that
side's answer, whose saved text becomes the chosen answer and the answer it was made from the rejected one, so the
pair teaches exactly what the edit changed. Undo takes the last pair saved out again. "Train on my preferences"
asks the window to start a DPO run from the loaded run's adapter (``train_requested``); a button that cannot act
says why beside it.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import describe_error
from engine.data.preferences import PreferenceStore, SavedPair, missing_pairs
from engine.run.preference_run import train_on_preferences

SIDES = ("tuned", "base")
"""The Chat page's panes, left to right."""


class AnswerEditor(QDialog):
    """An answer to edit into the one wanted; Save keeps the text (``text()``)."""

    def __init__(self, answer: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Edit into the chosen answer")
        self.editor = QPlainTextEdit(answer)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.save_button = buttons.button(QDialogButtonBox.StandardButton.Save)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Write the answer you wanted; the model's answer becomes the rejected one."))
        layout.addWidget(self.editor, 1)
        layout.addWidget(buttons)
        self.resize(640, 360)

    def text(self) -> str:
        return self.editor.toPlainText()


class PreferenceBar(QWidget):
    """The choice buttons under the answers, and the saved pairs' count, undo, export and training."""

    chosen = Signal(str)
    """The text kept as the answer (the chat goes on from it)."""
    train_requested = Signal(object)
    """A RunConfig: the DPO run on the saved pairs, for the window's run page to start."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store: PreferenceStore | None = None
        self.run_folder: str | None = None
        self.adapter = "best"
        self.run_id: str | None = None
        self.run_active = False
        self.prompt: list[dict[str, str]] = []
        self.answers: dict[str, str] = {}
        self.sources: dict[str, str] = {}
        self.last_saved: SavedPair | None = None
        self.editor: AnswerEditor | None = None
        self.better = {side: QPushButton("This one is better") for side in SIDES}
        self.edit = {side: QPushButton("Edit into the chosen answer…") for side in SIDES}
        for side in SIDES:
            self.better[side].clicked.connect(lambda _=False, s=side: self.pick(s))
            self.edit[side].clicked.connect(lambda _=False, s=side: self.open_editor(s))
        self.choice_note = QLabel("")
        self.count_label = QLabel("")
        self.undo_button = QPushButton("Undo")
        self.undo_button.clicked.connect(self.undo)
        self.export_button = QPushButton("Export…")
        self.export_button.clicked.connect(self.export)
        self.train_button = QPushButton("Train on my preferences")
        self.train_button.clicked.connect(self.train)
        self.train_note = QLabel("")
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self._layout()
        self.withdraw("ask for two answers to pick the better one")
        self.refresh()

    def _layout(self) -> None:
        choices = QHBoxLayout()
        for side in SIDES:  # each pair of buttons under its pane, one above the other: side by side, the four
            half = QVBoxLayout()  # were wider than the page in the window's smallest size
            half.addWidget(self.better[side], 0, Qt.AlignmentFlag.AlignLeft)
            half.addWidget(self.edit[side], 0, Qt.AlignmentFlag.AlignLeft)
            choices.addLayout(half, 1)
        saved = QHBoxLayout()
        saved.addWidget(self.count_label)
        for widget in (self.undo_button, self.export_button, self.train_button):
            saved.addWidget(widget)
        saved.addWidget(self.train_note, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(choices)
        layout.addWidget(self.choice_note)
        layout.addLayout(saved)
        layout.addWidget(self.message)

    # ----------------------------------------------------------------------------------------------- state

    def set_run(self, folder: str | None, adapter: str = "best", run_id: str | None = None) -> None:
        """The run whose model answers: its base model's pairs are counted, and training starts from its adapter."""
        self.run_folder, self.adapter, self.run_id = folder, adapter, run_id
        self.last_saved = None
        try:
            self.store = PreferenceStore.for_run(folder) if folder else None
        except Exception as err:  # a damaged run folder: chatting may still work, saving pairs cannot
            self.store = None
            self.message.setText(f"preferences cannot be saved for this run: {describe_error(err).message}")
        self.withdraw("ask for two answers to pick the better one")
        self.refresh()

    def set_run_active(self, active: bool) -> None:
        self.run_active = active
        self.refresh()

    def offer(self, prompt: list[dict[str, str]], answers: dict[str, str], sources: dict[str, str]) -> None:
        """Two answers to ``prompt`` (a side's text and who wrote it), ready to be judged."""
        self.prompt, self.answers, self.sources = list(prompt), dict(answers), dict(sources)
        if any(not answers.get(side, "").strip() for side in SIDES):
            self.withdraw("an answer is empty: ask again")
        elif answers[SIDES[0]] == answers[SIDES[1]]:
            self.withdraw("the two answers are the same: ask again (with a temperature above 0 for two samples)")
        else:
            self._enable_choice(True, "which answer is better? Or edit one into the answer you wanted")

    def withdraw(self, reason: str) -> None:
        """No pair to judge now, and why."""
        self._enable_choice(False, reason)

    def _enable_choice(self, enabled: bool, note: str) -> None:
        possible = enabled and self.store is not None
        for side in SIDES:
            self.better[side].setEnabled(possible)
            self.edit[side].setEnabled(possible)
        self.choice_note.setText(note if self.store is not None else "load a run to save preferences")

    def refresh(self) -> None:
        """The count and what the buttons below it can do."""
        count = self.store.count() if self.store is not None else 0
        noun = "preference" if count == 1 else "preferences"
        self.count_label.setText(f"{count} {noun} saved for {self.store.label}" if self.store is not None else "")
        self.undo_button.setEnabled(self.last_saved is not None)
        self.export_button.setEnabled(count > 0)
        why = self._cannot_train(count)
        self.train_button.setEnabled(why is None)
        self.train_note.setText(why or "")

    def _cannot_train(self, count: int) -> str | None:
        if self.store is None:
            return "load a run first"
        if self.run_active:
            return "a run is going: wait for it to end"
        return missing_pairs(count)

    # ---------------------------------------------------------------------------------------------- actions

    def pick(self, side: str) -> None:
        """Keep ``side``'s answer over the other one."""
        other = SIDES[1 - SIDES.index(side)]
        self._save(self.answers[side], self.answers[other], self.sources[side], self.sources[other], edited=False)

    def open_editor(self, side: str) -> AnswerEditor:
        """The editor with ``side``'s answer; saving it keeps the edit over that answer."""
        self.editor = AnswerEditor(self.answers[side], self)
        self.editor.accepted.connect(lambda: self._save_edit(side))
        self.editor.open()
        return self.editor

    def _save_edit(self, side: str) -> None:
        assert self.editor is not None
        text = self.editor.text()
        if text.strip() == self.answers[side].strip():
            self.message.setText("the edit changed nothing: pick “This one is better” to keep the answer as it is")
            return
        source = self.sources[side]
        self._save(text, self.answers[side], f"your edit of {source}", source, edited=True)

    def _save(self, chosen: str, rejected: str, chosen_by: str, rejected_by: str, *, edited: bool) -> None:
        assert self.store is not None
        try:
            self.last_saved = self.store.add(
                self.prompt, chosen, rejected, chosen_by=chosen_by, rejected_by=rejected_by, run=self.run_id,
                edited=edited,
            )  # fmt: skip
        except Exception as err:
            self.message.setText(f"not saved: {describe_error(err).message}")
            return
        self.message.setText(f"saved: {chosen_by} over {rejected_by}")
        self.withdraw("saved; the chat goes on from the chosen answer")
        self.refresh()
        self.chosen.emit(chosen)

    def undo(self) -> None:
        """Take the last pair saved out of the store again; its answers can be judged anew."""
        if self.store is None or self.last_saved is None:
            return
        removed = self.store.remove(self.last_saved.id)
        self.last_saved = None
        self.message.setText("the last preference was taken out" if removed else "the last preference was gone")
        if self.answers:
            self.offer(self.prompt, self.answers, self.sources)
        self.refresh()

    def export(self) -> str | None:
        """Write the pairs as DPO data to a file the user picks; its path (None when cancelled or failed)."""
        if self.store is None:
            return None
        suggested = str(Path.home() / f"preferences-{self.store.label}.jsonl")
        path, _ = QFileDialog.getSaveFileName(self, "Export preferences", suggested, "JSON Lines (*.jsonl)")
        if not path:
            return None
        try:
            count = self.store.export(path)
        except Exception as err:
            self.message.setText(f"not exported: {describe_error(err).message}")
            return None
        self.message.setText(f"{count} pairs written to {path} (DPO data: tunedeck train --method dpo --data …)")
        return path

    def train(self) -> None:
        """Ask for a DPO run on the saved pairs, from the loaded run's adapter."""
        if self.run_folder is None or self._cannot_train(self.store.count() if self.store else 0):
            return
        try:
            config = train_on_preferences(self.run_folder, self.adapter)
        except Exception as err:
            info = describe_error(err)
            self.message.setText(f"cannot train: {info.message}" + (f" ({info.hint})" if info.hint else ""))
            return
        self.message.setText(f"a DPO run on the saved pairs starts from {Path(self.run_folder).name}'s adapter")
        self.train_requested.emit(config)
