"""Every page starts the same way: its title and one line saying what the page is for.

The main window puts a :class:`Page` (header above the panel) in its page stack, so the panels themselves carry
no title and every page lines up alike.
"""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QVBoxLayout, QWidget

PAGE_TEXT = {
    "This computer": "The GPU TuneDeck found, and what it will use on it, each choice with its reason.",
    "Model": "The model to fine-tune: the built-in demo, a local folder or a Hugging Face hub id.",
    "Dataset": "The examples to learn from, checked row by row, with the tokens that will be trained.",
    "Setup": "How long and how hard to train: a preset, or every setting under Advanced.",
    "Recipe": "How long and how hard to train, in plain words, with its memory and time on this computer.",
    "Run": "Start, pause and stop the run, and watch its loss, speed and memory live.",
    "Speed": "Each speed optimization, whether it is on here and why; flip one live or measure them.",
    "Report": "Did the fine-tune help, and what did it forget? Base model and tuned side by side on held-out examples.",
    "GPU setup": "Install or repair the torch build that matches this computer's GPU.",
    "Runs": "Every run so far: compare their loss curves, resume a stopped one, export a finished one.",
    "Chat": "Talk to a fine-tuned model, with the base model's answer to the same prompt beside it.",
}
"""The one-line explanation under each page's title."""


class PageHeader(QWidget):
    """A page's title (large, bold) and one line of explanation, over a thin rule."""

    def __init__(self, title: str, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel(title)
        font = self.title.font()
        font.setPointSizeF(font.pointSizeF() * 1.5)
        font.setBold(True)
        self.title.setFont(font)
        self.text = QLabel(text)
        self.text.setWordWrap(True)
        rule = QFrame()
        rule.setFrameShape(QFrame.Shape.HLine)
        rule.setFrameShadow(QFrame.Shadow.Sunken)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(11, 8, 11, 0)
        layout.setSpacing(2)
        layout.addWidget(self.title)
        layout.addWidget(self.text)
        layout.addSpacing(4)
        layout.addWidget(rule)


class Page(QWidget):
    """A panel under its header; ``panel`` is the page's own widget. The panel fills the page and shrinks with the
    window down to its own smallest size, then scrolls (``scrolls``, the default): a page's content (a long form, a
    full gallery) never makes the window taller or wider than a laptop screen, nor grows it."""

    def __init__(self, title: str, panel: QWidget, text: str | None = None, scrolls: bool = True) -> None:
        super().__init__()
        self.panel = panel
        self.header = PageHeader(title, PAGE_TEXT.get(title, "") if text is None else text)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.header)
        layout.addWidget(_scrolling(panel) if scrolls else panel, 1)


def _scrolling(panel: QWidget) -> QScrollArea:
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)  # the panel fills the page, and scrolls only below its own minimum
    scroll.setFrameShape(QFrame.Shape.NoFrame)
    scroll.setWidget(panel)
    return scroll
