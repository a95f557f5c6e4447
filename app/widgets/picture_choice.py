"""The picture a chat question is about, for a vision-language fine-tune: a button to choose one, its file name,
and a button to ask without it."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QPushButton, QWidget

PICTURE_FILES = "Pictures (*.png *.jpg *.jpeg *.webp *.gif *.bmp *.tif *.tiff)"


class PictureChoice(QWidget):
    """Which picture the next question is about (``path``; None: a question without one)."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.path: str | None = None
        self.choose = QPushButton("Picture…")
        self.choose.setToolTip("Ask about a picture: the fine-tuned and the base model see it with your message")
        self.choose.clicked.connect(self._choose)
        self.name = QLabel("")
        self.drop = QPushButton("No picture")
        self.drop.clicked.connect(lambda: self.set_path(None))
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for widget in (self.choose, self.name, self.drop):
            layout.addWidget(widget)
        self.set_path(None)

    def set_path(self, path: str | None) -> None:
        self.path = path
        self.name.setText(Path(path).name if path else "")
        self.name.setToolTip(path or "")
        self.drop.setVisible(path is not None)
        self.changed.emit()

    def _choose(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Picture", "", PICTURE_FILES)
        if path:
            self.set_path(path)
