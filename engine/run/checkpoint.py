"""Resumable checkpoints, written so that a crash never leaves a half-written one that looks good.

A checkpoint is a folder ``checkpoints/step-NNNNNN`` holding the adapter weights (safetensors), the optimizer,
scheduler and RNG states, and ``trainer_state.json`` (step and data position). It is written into a temporary
folder, every file is fsynced, and only then is the folder renamed into place, so a folder named ``step-*``
is always complete. A ``manifest.json`` records every file's size and SHA-256, so a checkpoint damaged later
(a disk error, a copy cut short) is recognised and skipped on resume. Older checkpoints are pruned after the new
one is in place, by renaming them out of the ``step-*`` namespace first, so a kill mid-delete leaves nothing
that looks like a checkpoint. A failed write (disk full, permission denied) removes its temporary folder and
raises a :class:`~engine.errors.TuneDeckError` saying what could not be written where; the previous checkpoint
is untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import TuneDeckError

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
REFERENCE_FILE = "reference.safetensors"
"""A DPO run's reference log-probabilities (engine.run.preference), in its checkpoints."""
DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclass(frozen=True)
class TrainerState:
    """Where training stands: the optimizer step and how many micro-batches have been consumed."""

    step: int
    micro_batches: int
    train_rows: int
    total_steps: int
    tokens_per_batch: int = 0
    """Micro-batch budget in force (lowered after out-of-memory steps); 0 in checkpoints from before it was kept."""


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
        # POSIX cannot rename over a non-empty folder; a kill between the two renames leaves .old-NAME,
        # which recover_interrupted() puts back.
        trash = final.with_name(f".old-{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
        try:
            tmp.rename(final)
        except OSError:
            trash.rename(final)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)


def recover_interrupted(folder: Path) -> None:
    """Undo what a kill in the middle of commit_folder or pruning left in ``folder``."""
    if not folder.is_dir():
        return
    for old in folder.glob(".old-*"):
        final = folder / old.name[len(".old-") :]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(final)
    for leftover in [*folder.glob(".tmp-*"), *folder.glob(".trash-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def write_error(err: OSError, what: str, where: Path) -> TuneDeckError:
    """A message naming what could not be written where, and why in words a user knows."""
    if err.errno in DISK_FULL:
        reason = "the disk is full"
        hint = "free some space on that disk (or pick another output folder), then resume the run"
    elif err.errno in NO_PERMISSION:
        reason = "permission denied"
        hint = "make the folder writable (or pick another output folder), then resume the run"
    else:
        reason = err.strerror or str(err)
        hint = "check the disk, then resume the run"
    return TuneDeckError(f"{reason}: cannot write the {what} to {where}", hint=f"{hint}; the last checkpoint is intact")


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves either the old or the new file, never half of one."""
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    if path.exists():
        with path.open("rb+") as handle:
            os.fsync(handle.fileno())


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
    reference: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint atomically and prune all but the newest ``keep``; returns its folder. ``reference``: a DPO
    run's reference log-probabilities, kept so that a resumed run measures against the same reference."""
    final = folder / checkpoint_name(state.step)
    tmp = folder / f".tmp-{final.name}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_checkpoint_files(tmp, state, adapter_state, optimizer, scheduler, reference)
        commit_folder(tmp, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(err, f"checkpoint {final.name}", folder) from err
    prune_checkpoints(folder, keep)
    return final


def _write_checkpoint_files(
    tmp: Path,
    state: TrainerState,
    adapter_state: dict[str, torch.Tensor],
    optimizer: Any,
    scheduler: Any,
    reference: dict[str, torch.Tensor] | None = None,
) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state.items()}, tmp / "adapter.safetensors")
    if reference is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in reference.items()}, tmp / REFERENCE_FILE)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2), encoding="utf-8")
    manifest = {item.name: _fingerprint(item) for item in sorted(tmp.iterdir()) if item.is_file()}
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def _fingerprint(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be trusted (a missing or changed file), or None when it is whole."""
    manifest_path = checkpoint / MANIFEST_FILE
    if not manifest_path.exists():  # written before manifests existed: the atomic rename still vouches for it
        return None if (checkpoint / STATE_FILE).exists() else f"{STATE_FILE} is missing"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"{MANIFEST_FILE} is unreadable ({err})"
    for name, expected in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"] or _fingerprint(path)["sha256"] != expected["sha256"]:
            return f"{name} is damaged (its size or checksum changed)"
    return None


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary and partial folders are ignored)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    complete = [p for p in found if (p / STATE_FILE).exists()]
    return sorted(complete, key=lambda p: p.name)


def prune_checkpoints(folder: Path, keep: int) -> None:
    for old in list_checkpoints(folder)[:-keep]:
        trash = folder / f".trash-{old.name}"
        try:
            old.rename(trash)  # out of the step-* namespace first: a kill mid-delete leaves no partial checkpoint
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
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


def load_reference(checkpoint: Path) -> dict[str, torch.Tensor] | None:
    """A DPO checkpoint's reference log-probabilities, or None where it holds none (not DPO, or written before
    checkpoints kept them)."""
    from safetensors.torch import load_file

    path = checkpoint / REFERENCE_FILE
    return load_file(path) if path.is_file() else None
