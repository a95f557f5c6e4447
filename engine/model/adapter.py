"""Starting a run from an earlier run's LoRA adapter instead of a fresh one.

A run folder holds its final adapter in ``adapter/`` (PEFT format); any PEFT LoRA folder (``adapter_config.json``
and ``adapter_model.safetensors``) works too. The new run takes the adapter's own rank, alpha, dropout and target
modules, so its weights load into a LoRA of the same shape, and then trains them further (a DPO run after a
supervised one, for instance). Only safetensors weights are read.

A run with held-out data also keeps ``adapter-best/``, its weights at the lowest held-out loss: exports, chat and a
new run started from the run take that one unless asked for the last (:func:`run_adapter`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import LoraConfig
from engine.errors import ModelLoadError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_folder(location: str | Path, which: str = "best") -> Path:
    """The PEFT folder at ``location``: the folder itself, or a run folder's adapter as chat and export take it:
    its best (``adapter-best/``, where it kept one) unless ``which`` is ``last`` (``adapter/``)."""
    folder = Path(location).expanduser()
    chosen = None if (folder / ADAPTER_CONFIG).is_file() else run_adapter(folder, which)
    for candidate in (folder,) if chosen is None else (chosen.folder,):
        if (candidate / ADAPTER_CONFIG).is_file():
            if not (candidate / ADAPTER_WEIGHTS).is_file():
                raise ModelLoadError(f"{candidate} has no {ADAPTER_WEIGHTS}", hint="only safetensors adapters load")
            return candidate
    raise ModelLoadError(
        f"no LoRA adapter in {folder}",
        hint="--adapter takes a finished run's folder (it holds adapter/), a run id or name, or a PEFT adapter folder",
    )


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        raw = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {folder / ADAPTER_CONFIG}: {err}") from err
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{folder} is not a LoRA adapter", hint="only LoRA adapters can be trained further")
    return raw


def adapter_lora(folder: Path, lora: LoraConfig) -> LoraConfig:
    """``lora`` with the adapter's own rank, alpha, dropout and targets (the shape its weights need)."""
    raw = _read_config(folder)
    targets = raw.get("target_modules") or lora.target_modules
    if isinstance(targets, str):
        targets = [targets]
    try:
        return dataclasses.replace(
            lora,
            rank=int(raw.get("r", lora.rank)),
            alpha=float(raw.get("lora_alpha", lora.alpha)),
            dropout=float(raw.get("lora_dropout", lora.dropout)),
            target_modules=sorted(targets),
        )
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{folder / ADAPTER_CONFIG} has settings LoRA cannot use: {err}") from err


def load_adapter_weights(model: Any, folder: Path) -> int:
    """Copy the adapter's weights into ``model``'s LoRA (built with :func:`adapter_lora`); returns how many tensors
    were loaded. Every LoRA weight of the model must be in the file and the other way round."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(folder / ADAPTER_WEIGHTS))
    try:
        result: Any = set_peft_model_state_dict(model, weights)
    except RuntimeError as err:  # shapes that do not match
        raise ModelLoadError(f"the adapter in {folder} does not fit this model: {str(err).splitlines()[0]}") from err
    missing = [key for key in result.missing_keys if "lora_" in key]
    if result.unexpected_keys or missing:
        names = (list(result.unexpected_keys) + missing)[:3]
        raise ModelLoadError(
            f"the adapter in {folder} does not fit this model (for example {', '.join(names)})",
            hint="start from an adapter trained on the same base model",
        )
    return len(weights)


LAST_ADAPTER = "adapter"
"""A run folder's final adapter, written when the run ends (engine.run.folder.ADAPTER_DIR)."""
BEST_ADAPTER = "adapter-best"
"""The adapter of the run's lowest held-out loss so far, kept beside the last one (engine.run.best)."""
BEST_RECORD = "best.json"
"""Inside ``adapter-best/``: the step and held-out loss the kept weights come from (written with them)."""
ADAPTER_CHOICES = ("best", "last")


@dataclass(frozen=True)
class RunAdapter:
    """One of a run's adapters: the folder, which one it is, and for the best one where it comes from."""

    folder: Path
    which: str
    """``best`` (the lowest held-out loss) or ``last`` (the weights the run ended with)."""
    step: int | None = None
    eval_loss: float | None = None

    def describe(self) -> str:
        """In words, e.g. ``the best adapter (step 40, held-out loss 0.787)`` or ``the last adapter``."""
        if self.which == "last":
            return "the last adapter"
        loss = f", held-out loss {self.eval_loss:.3f}" if self.eval_loss is not None else ""
        return f"the best adapter (step {self.step}{loss})"


def best_adapter(run_folder: str | Path) -> RunAdapter | None:
    """The run's kept best adapter, or None where it has none (no held-out split, or a run from before it was
    kept)."""
    folder = Path(run_folder) / BEST_ADAPTER
    if not (folder / ADAPTER_CONFIG).is_file():
        return None
    try:
        record = json.loads((folder / BEST_RECORD).read_text(encoding="utf-8"))
        return RunAdapter(folder, "best", int(record["step"]), float(record["eval_loss"]))
    except (OSError, ValueError, KeyError, TypeError):
        return RunAdapter(folder, "best")


def run_adapter(run_folder: str | Path, which: str = "best") -> RunAdapter | None:
    """The adapter of a run that exports and chat use: ``best`` where the run kept one, else the last; ``last``
    the weights the run ended with. None when the run has no adapter of that kind yet."""
    if which not in ADAPTER_CHOICES:
        raise ModelLoadError(f"unknown adapter {which!r}", hint=f"use one of {', '.join(ADAPTER_CHOICES)}")
    best = best_adapter(run_folder) if which == "best" else None
    if best is not None:
        return best
    last = Path(run_folder) / LAST_ADAPTER
    return RunAdapter(last, "last") if (last / ADAPTER_CONFIG).is_file() else None
