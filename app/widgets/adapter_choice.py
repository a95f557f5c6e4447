"""Which of a run's adapters to use: the best (the lowest held-out loss, the default) or the last.

A run with held-out data keeps ``adapter-best/`` beside the final ``adapter/`` (engine.run.best); the Chat page
and the export dialog offer both, each item saying where its weights come from. A run without a best adapter
offers only the last.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QComboBox

from engine.model.adapter import best_adapter, run_adapter


class AdapterChoice(QComboBox):
    """Best or last adapter of one run; ``which()`` is what engine.export and engine.model.chat take."""

    def __init__(self) -> None:
        super().__init__()
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)  # its words follow the run shown
        self.folder: Path | None = None
        """The run whose adapters are listed."""
        self.setToolTip(
            "The best adapter is the run's weights at its lowest held-out loss; the last one is what the run "
            "ended with (later steps may have fitted the training examples at the cost of new ones)"
        )

    def show_run(self, folder: str | Path | None) -> None:
        """Offer the adapters of the run in ``folder`` (nothing for None), the best one first and chosen."""
        self.clear()
        self.folder = Path(folder) if folder is not None else None
        if folder is None:
            return
        best = best_adapter(folder)
        if best is not None:
            where = f"step {best.step}, held-out loss {best.eval_loss:.3f}" if best.eval_loss is not None else ""
            self.addItem(f"Best adapter ({where})" if where else "Best adapter", "best")
        last = run_adapter(folder, "last")
        if last is not None:
            self.addItem("Last adapter (where the run ended)", "last")
        self.setCurrentIndex(0 if self.count() else -1)
        self.setEnabled(self.count() > 1)

    def which(self) -> str:
        """``best`` or ``last``; ``best`` (which falls back to the last) when nothing is listed."""
        return str(self.currentData() or "best")
