"""The chat page: talk to a fine-tuned model, and see the base model answer the same prompt beside it.

Loading a model and generating both take seconds to minutes, so each runs in a QThread; the panel only shows
what the threads report. A reply streams into its pane piece by piece; Stop sets an event that the generation
checks after every token. The tuned and base replies come from one loaded model (the adapter is switched off
for the base reply), one after the other, so memory holds the weights once. torch is imported only inside the
threads (through ``engine.model.chat``), never by this module.

Two answers (the fine-tuned and the base model's, or two samples of the fine-tuned model) can be judged under the
panes (app.widgets.preference_bar): the pair is saved for the run's base model, and the chat goes on from the
answer kept. A pair is offered only while both sides answered the same conversation.
"""

from __future__ import annotations

import html
import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import QThread, Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import describe_error
from app.widgets.adapter_choice import AdapterChoice
from app.widgets.picture_choice import PictureChoice
from app.widgets.preference_bar import PreferenceBar
from engine.data.preferences import PreferenceError, last_exchange
from engine.run.registry import Registry, RunRecord
from engine.run.summary import RunSummary, describe, summary_of_record

SIDES = ("tuned", "base")
PAIRINGS = {
    "base": ("Fine-tuned vs base model", {"tuned": "fine-tuned model", "base": "base model"}),
    "samples": ("Two of the fine-tuned model", {"tuned": "fine-tuned, answer 1", "base": "fine-tuned, answer 2"}),
}
"""What the two panes hold: a label for the choice and who answers in each pane."""


class ModelLoader(QThread):
    """Loads a run's adapter (best or last) on its base model (``engine.model.chat.load_chat_model``)."""

    loaded = Signal(object)
    failed = Signal(str)

    def __init__(self, folder: str, device: str = "auto", adapter: str = "best") -> None:
        super().__init__()
        self.folder = folder
        self.device = device
        self.adapter = adapter

    def run(self) -> None:
        try:
            from engine.model.chat import load_chat_model
            from engine.vision.export import run_vision_family

            if run_vision_family(Path(self.folder)) is not None:  # a vision-language run: answers about pictures
                from engine.vision.chat import load_image_chat

                self.loaded.emit(load_image_chat(self.folder, device=self.device, which=self.adapter))
                return
            self.loaded.emit(load_chat_model(self.folder, device=self.device, adapter=self.adapter))
        except Exception as err:
            info = describe_error(err)
            self.failed.emit(info.message + (f"\n{info.hint}" if info.hint else ""))


class ReplyWorker(QThread):
    """Streams the reply of each requested side in turn; ``stop`` ends the current one and skips the rest."""

    piece = Signal(str, str)
    reply_done = Signal(str, str)
    failed = Signal(str)

    def __init__(
        self,
        chat: Any,
        histories: dict[str, list[dict[str, str]]],
        settings: dict[str, Any],
        adapters: dict[str, bool] | None = None,
        picture: str | None = None,
    ) -> None:
        super().__init__()
        self.chat = chat
        self.picture = picture
        """A vision-language chat: the picture the last message asks about."""
        self.histories = histories
        self.settings = settings
        self.adapters = adapters or {side: side == "tuned" for side in histories}
        """Whether each side answers with the adapter on."""
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            from engine.model.chat import GenerationSettings, stream_reply

            settings = GenerationSettings(**self.settings)
            if is_picture_chat(self.chat):
                self._ask_about_picture(settings.max_new_tokens)
                return
            for side, messages in self.histories.items():
                if self.stop.is_set():
                    break
                text = []
                use_adapter = self.adapters[side]
                for part in stream_reply(self.chat, messages, settings, use_adapter=use_adapter, stop=self.stop):
                    text.append(part)
                    self.piece.emit(side, part)
                self.reply_done.emit(side, "".join(text))
        except Exception as err:
            self.failed.emit(describe_error(err).message)

    def _ask_about_picture(self, max_new_tokens: int) -> None:
        """Each side's greedy answer to the last message, about the picture (engine.vision.chat.ask)."""
        from engine.vision.chat import ask

        for side, messages in self.histories.items():
            if self.stop.is_set():
                break
            text = ask(self.chat, messages[-1]["content"], self.picture, self.adapters[side], max_new_tokens)
            self.piece.emit(side, text)
            self.reply_done.emit(side, text)


def is_picture_chat(chat: Any) -> bool:
    """Whether ``chat`` is a vision-language run's (engine.vision.chat.ImageChat), which answers about pictures."""
    return getattr(chat, "processor", None) is not None


class ChatView(QWidget):
    """Run picker, generation settings, the two reply panes, the preference bar and the prompt line."""

    train_requested = Signal(object)
    """A RunConfig: the DPO run on the saved preferences, for the window's Run page to start."""

    def __init__(self, registry: Registry | None = None, parent: QWidget | None = None, device: str = "auto") -> None:
        super().__init__(parent)
        self.registry = registry
        self.device = device
        self.chat: Any = None
        self.loader: ModelLoader | None = None
        self.worker: ReplyWorker | None = None
        self.histories: dict[str, list[dict[str, str]]] = {side: [] for side in SIDES}
        self.records: dict[str, RunRecord] = {}
        self.loading_folder: str | None = None
        self.live = RunSummary()
        self.run_info = QLabel("")
        """The chosen run's state, measured peak memory and speed, as every page words them."""
        self.run_info.setWordWrap(True)
        self.status = QLabel("Choose a finished run to chat with its fine-tuned model.")
        self.status.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addLayout(self._build_picker())
        layout.addWidget(self.run_info)
        layout.addWidget(self._build_settings())
        layout.addLayout(self._build_panes(), 1)
        self.preferences = PreferenceBar()
        self.preferences.chosen.connect(self._keep_answer)
        self.preferences.train_requested.connect(self.train_requested)
        layout.addWidget(self.preferences)
        layout.addLayout(self._build_prompt())
        layout.addWidget(self.status)
        self.refresh_runs()
        self._update_buttons()

    def _build_picker(self) -> QVBoxLayout:
        self.runs = QComboBox()
        self.runs.setMinimumWidth(240)
        self.runs.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.runs.currentIndexChanged.connect(lambda _index: self.show_run_info())
        self.adapter = AdapterChoice()
        self.load_button = QPushButton("Load")
        self.load_button.clicked.connect(lambda: self.load_run(self.runs.currentData()))
        browse = QPushButton("Open run folder…")
        browse.clicked.connect(self._browse)
        # the adapter and the buttons take a row of their own: beside a run's name they pushed the page past a
        # laptop's narrow window, cutting the adapter's words
        run_row, adapter_row = QHBoxLayout(), QHBoxLayout()
        run_row.addWidget(QLabel("Run:"))
        run_row.addWidget(self.runs, 1)
        adapter_row.addWidget(QLabel("Adapter:"))
        adapter_row.addWidget(self.adapter)
        adapter_row.addWidget(self.load_button)
        adapter_row.addWidget(browse)
        adapter_row.addStretch(1)
        rows = QVBoxLayout()
        rows.addLayout(run_row)
        rows.addLayout(adapter_row)
        return rows

    def _build_settings(self) -> QGroupBox:
        box = QGroupBox("Generation")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, value=0.7, decimals=2)
        self.temperature.setToolTip("0 always picks the most likely token (the same reply every time)")
        self.top_p = QDoubleSpinBox(minimum=0.05, maximum=1.0, singleStep=0.05, value=0.9, decimals=2)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=256)
        self.compare = QCheckBox("Two answers:")
        self.compare.setChecked(True)
        self.pairing = QComboBox()
        for key, (label, _) in PAIRINGS.items():
            self.pairing.addItem(label, key)
        self.pairing.currentIndexChanged.connect(lambda _index: self._name_panes())
        self.compare.toggled.connect(self.pairing.setEnabled)
        form = QFormLayout(box)
        row = QHBoxLayout()
        for label, widget in (
            ("Temperature", self.temperature),
            ("Top-p", self.top_p),
            ("Max tokens", self.max_tokens),
        ):
            row.addWidget(QLabel(label))
            row.addWidget(widget)
        row.addStretch(1)
        pair = QHBoxLayout()  # a row of its own: beside the numbers it was wider than the smallest window's page
        pair.addWidget(self.compare)
        pair.addWidget(self.pairing)
        pair.addStretch(1)
        form.addRow(row)
        form.addRow(pair)
        return box

    def _build_panes(self) -> QHBoxLayout:
        self.panes = {side: QTextBrowser() for side in SIDES}
        self.pane_titles = {side: QLabel() for side in SIDES}
        self._name_panes()
        row = QHBoxLayout()
        for side in SIDES:
            column = QVBoxLayout()
            column.addWidget(self.pane_titles[side])
            column.addWidget(self.panes[side], 1)
            row.addLayout(column)
        return row

    def _name_panes(self) -> None:
        for side, who in self.answerers().items():
            self.pane_titles[side].setText(f"<b>{who[0].upper()}{who[1:]}</b>")

    def answerers(self) -> dict[str, str]:
        """Who answers in each pane, as the pairs saved from them name it."""
        return PAIRINGS[self.pairing.currentData() or "base"][1]

    def _build_prompt(self) -> QHBoxLayout:
        self.prompt = QLineEdit(placeholderText="Type a message and press Enter")
        self.prompt.returnPressed.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        clear = QPushButton("New chat")
        clear.clicked.connect(self.clear)
        self.picture = PictureChoice()
        self.picture.hide()  # shown for a vision-language run
        row = QHBoxLayout()
        row.addWidget(self.picture)
        row.addWidget(self.prompt, 1)
        for button in (self.send_button, self.stop_button, clear):
            row.addWidget(button)
        return row

    # --------------------------------------------------------------------------------------------- loading

    def refresh_runs(self) -> None:
        """Fill the picker with the registry's runs that have an adapter to load, keeping the chosen one.

        The main window calls this whenever a run ends, so a run finished in this session can be loaded at once.
        """
        try:
            records = (self.registry or Registry()).runs()
        except Exception as err:  # a broken history must not break chatting with a folder
            self.status.setText(f"cannot read the run history: {err}")
            return
        self.show_runs(records)

    def show_runs(self, records: list[RunRecord]) -> None:
        """List ``records`` (the run history, newest first) that have an adapter: a deleted run goes, a renamed one
        shows its new name, the chosen one stays chosen."""
        chosen = self.runs.currentData()
        listed = {self.runs.itemData(i) for i in range(self.runs.count())}
        self.runs.blockSignals(True)
        self.runs.clear()
        self.records = {}
        for record in records:
            if (Path(record.folder) / "adapter" / "adapter_config.json").exists():
                self.runs.addItem(f"{record.name}  ({Path(record.model).name or record.model})", record.folder)
                self.records[record.folder] = record
        self.runs.blockSignals(False)
        newest = self.runs.itemData(0) if self.runs.count() else None  # the registry lists the newest first
        if newest is not None and newest not in listed:
            chosen = newest  # a run that just finished is the one to try
        index = self.runs.findData(chosen) if chosen is not None else -1
        self.runs.setCurrentIndex(max(index, 0) if self.runs.count() else -1)
        self.show_run_info()
        self._update_buttons()

    def show_live(self, summary: RunSummary) -> None:
        """The window's run changed (the main window passes it on): shown here when it is the chosen run."""
        self.live = summary
        self.preferences.set_run_active(summary.active)
        chosen = self.runs.currentData()
        if chosen and summary.run_dir and Path(summary.run_dir).resolve() == Path(chosen).resolve():
            self.show_run_info()

    def show_run_info(self) -> None:
        """The chosen run's summary: the live one while the window runs it, else from its folder."""
        record = self.records.get(self.runs.currentData() or "")
        self.adapter.show_run(record.folder if record is not None else None)
        if record is None:
            self.run_info.setText("")
            return
        live = bool(self.live.run_dir) and Path(self.live.run_dir).resolve() == Path(record.folder).resolve()
        summary = self.live if live and self.live.active else summary_of_record(record)
        self.run_info.setText(describe(summary).line())

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Run folder")
        if folder:
            self.load_run(folder)

    def load_run(self, folder: str | None) -> None:
        if not folder or self._busy():
            return
        self.chat = None
        self.loading_folder = str(folder)
        self.status.setText(f"loading {Path(folder).name}…")
        if self.adapter.folder != Path(folder):  # a folder opened by hand: its own adapters, the best first
            self.adapter.show_run(folder)
        self.loader = ModelLoader(str(folder), self.device, self.adapter.which())
        self.loader.loaded.connect(self._loaded)
        self.loader.failed.connect(self._failed)
        self.loader.finished.connect(self._update_buttons)
        self.loader.start()
        self._update_buttons()

    def _loaded(self, chat: Any) -> None:
        self.chat = chat
        self.clear()
        self.picture.setVisible(is_picture_chat(chat))
        record = self.records.get(self.loading_folder or "")
        which = chat.adapter.which if chat.adapter is not None else "best"
        self.preferences.set_run(self.loading_folder, which, record.id if record is not None else None)
        which = chat.adapter.describe() if chat.adapter is not None else "its adapter"
        self.status.setText(f"{chat.label} loaded on {chat.device}: the left pane answers with {which}")

    def _failed(self, message: str) -> None:
        self.status.setText(f"error: {message}")

    # ------------------------------------------------------------------------------------------ chatting

    def _busy(self) -> bool:
        return any(thread is not None and thread.isRunning() for thread in (self.loader, self.worker))

    def _update_buttons(self) -> None:
        busy = self._busy()
        generating = self.worker is not None and self.worker.isRunning()
        self.send_button.setEnabled(self.chat is not None and not busy)
        self.stop_button.setEnabled(generating)
        self.load_button.setEnabled(not busy and self.runs.count() > 0)

    def settings(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature.value(),
            "top_p": self.top_p.value(),
            "max_new_tokens": self.max_tokens.value(),
        }

    def send(self, text: str | None = None) -> None:
        text = (text if isinstance(text, str) else self.prompt.text()).strip()
        if not text or self.chat is None or self._busy():
            return
        self.prompt.clear()
        sides = SIDES if self.compare.isChecked() else ("tuned",)
        self.preferences.withdraw("generating…")
        picture = self.picture.path if is_picture_chat(self.chat) else None
        about = f" <i>(about {html.escape(Path(picture).name)})</i>" if picture else ""
        for side in sides:
            self.histories[side].append({"role": "user", "content": text})
            self.panes[side].append(f"<p><b>You:</b> {html.escape(text)}{about}</p>")
            self.panes[side].append("<b>Model:</b> ")
        adapters = {side: side == "tuned" or self.pairing.currentData() == "samples" for side in sides}
        histories = {side: list(self.histories[side]) for side in sides}
        self.worker = ReplyWorker(self.chat, histories, self.settings(), adapters, picture)
        self.worker.piece.connect(self._piece)
        self.worker.reply_done.connect(self._reply_done)
        self.worker.failed.connect(self._failed)
        self.worker.finished.connect(self._update_buttons)
        self.worker.finished.connect(self._offer_pair)
        self.worker.start()
        self.status.setText("generating…")
        self._update_buttons()

    def _piece(self, side: str, text: str) -> None:
        cursor = self.panes[side].textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text)
        self.panes[side].setTextCursor(cursor)

    def _reply_done(self, side: str, text: str) -> None:
        self.histories[side].append({"role": "assistant", "content": text})
        self.status.setText("stopped" if self.worker is not None and self.worker.stop.is_set() else "done")

    def _offer_pair(self) -> None:
        """Both sides' last answers to judge, when they answer the same conversation."""
        try:
            prompt, *answers = last_exchange(*(self.histories[side] for side in SIDES))
        except PreferenceError as err:
            self.preferences.withdraw(err.message)
            return
        self.preferences.offer(prompt, dict(zip(SIDES, answers, strict=True)), self.answerers())

    def _keep_answer(self, text: str) -> None:
        """A preference was saved: both sides go on from the answer kept."""
        for side in SIDES:
            if self.histories[side] and self.histories[side][-1]["role"] == "assistant":
                self.histories[side][-1] = {"role": "assistant", "content": text}
                self.panes[side].append("<p><i>(the chat goes on from the answer kept)</i></p>")

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop.set()

    def clear(self) -> None:
        """Start a new conversation (the loaded model stays)."""
        self.histories = {side: [] for side in SIDES}
        for pane in self.panes.values():
            pane.clear()
        self.preferences.withdraw("ask for two answers to pick the better one")

    def closeEvent(self, event: Any) -> None:
        """Let running threads end before the widget goes away."""
        self.stop()
        for thread in (self.loader, self.worker):
            if thread is not None:
                thread.wait()
        super().closeEvent(event)
