"""Resumable checkpoints, written so that a crash never leaves a half-written one that looks good.

A checkpoint is a folder ``checkpoints/step-NNNNNN`` holding the adapter weights (safetensors), the optimizer,
scheduler and RNG states, and ``trainer_state.json`` (step and data position). It is written into a temporary
folder, every file is fsynced, and only then is the folder renamed into place, so a folder named ``step-*``
is always complete. Older checkpoints are pruned after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class TrainerState:
    """Where training stands: the optimizer step and how many micro-batches have been consumed."""

    step: int
    micro_batches: int
    train_rows: int
    total_steps: int


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def fsync_dir(path: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for item in folder.rglob("*"):
        if item.is_file():
            with item.open("rb+") as handle:
                os.fsync(handle.fileno())
    fsync_dir(folder)


def commit_folder(tmp: Path, final: Path) -> None:
    """Make a fully written temporary folder visible under its final name, replacing any older one."""
    _fsync_tree(tmp)
    if final.exists():
        trash = final.with_name(f".old-{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    folder: Path,
    state: TrainerState,
    adapter_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    keep: int,
) -> Path:
    """Write a checkpoint atomically and prune all but the newest ``keep``; returns its folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(state.step)
    tmp = folder / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state.items()}, tmp / "adapter.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2), encoding="utf-8")
    commit_folder(tmp, final)
    prune_checkpoints(folder, keep)
    return final


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary and partial folders are ignored)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    complete = [p for p in found if (p / STATE_FILE).exists()]
    return sorted(complete, key=lambda p: p.name)


def prune_checkpoints(folder: Path, keep: int) -> None:
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in folder.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def load_trainer_state(checkpoint: Path) -> TrainerState:
    return TrainerState(**json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8")))


def load_checkpoint(checkpoint: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, torch.Tensor]:
    """Restore optimizer, scheduler and RNG state; returns the adapter weights to put back into the model."""
    from safetensors.torch import load_file

    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
    restore_rng_state(torch.load(checkpoint / "rng.pt", weights_only=True))
    return load_file(checkpoint / "adapter.safetensors")
