"""Which entries of a run folder are TuneDeck's, and deleting a run without touching anything else.

When TuneDeck creates a run folder it first writes a marker, ``.tunedeck-run``, holding the run's id, and the run
history records the run under that id. Deleting a run removes TuneDeck's own entries one by one (the files and
folders a run writes, listed in ``RUN_FILES`` and ``RUN_FOLDERS``, and their temporary copies), never a symbolic
link's target, and removes the folder itself only when nothing else is left in it. Anything else (a file of the
user's, a link) stays, and the outcome says what stayed and why. A folder without the marker (a run from before
TuneDeck wrote one) or with another run's marker is treated the same way, and the outcome says so too.

Deciding is pure (:func:`plan_removal` over the entries' names and kinds); :func:`remove_run_folder` reads the
folder, decides and removes. This module imports no torch: the Runs page and ``tunedeck runs`` use it.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import TuneDeckError

MARKER_FILE = ".tunedeck-run"
"""Written into a run folder as TuneDeck creates it, holding the run's id (one line)."""
RUN_FILES = frozenset(
    {
        MARKER_FILE,
        "config.json",  # engine.run.folder.CONFIG_FILE
        "metrics.jsonl",  # METRICS_FILE
        "eval.jsonl",  # EVAL_FILE
        "memory.jsonl",  # MEMORY_FILE (engine.run.guard's out-of-memory changes)
        "compute.json",  # COMPUTE_FILE
        "error.log",  # engine.run.folder.write_error_log
        "report.md",  # engine.run.report.REPORT_MD
        "report.json",  # REPORT_JSON
        "control.json",  # engine.distributed.control.CONTROL_FILE (a run over several GPUs)
        "demo_result.json",  # tunedeck train --demo
    }
)
"""The files a run writes at the top of its folder (tests/test_run_names.py checks the modules' own names)."""
RUN_FOLDERS = frozenset(
    {
        "checkpoints",  # engine.run.folder.CHECKPOINT_DIR
        "adapter",  # ADAPTER_DIR
        "adapter-best",  # BEST_ADAPTER_DIR
        "exports",  # the app's export dialog writes <run folder>/exports/<kind> unless the user picks another folder
    }
)
"""The folders a run writes at the top of its folder; each is TuneDeck's whole."""
TEMPORARY_PREFIXES = (".tmp-", ".old-", ".trash-")
"""An atomic write's temporary copy of a file or folder (engine.run.checkpoint), left behind by a kill."""
RUN_ID = re.compile(r"[0-9a-f]{12}")
MARKER_MAX_BYTES = 64

Kind = Literal["file", "folder", "link", "other"]
MarkerState = Literal["matches", "missing", "other run"]


class RunFolderError(TuneDeckError):
    """A run folder that TuneDeck will not delete from (a link, or no sign of a run)."""


def new_run_id() -> str:
    """A fresh run id: 12 hex digits, as the run history writes them."""
    return uuid.uuid4().hex[:12]


def write_marker(folder: Path, run_id: str) -> None:
    (folder / MARKER_FILE).write_text(run_id + "\n", encoding="utf-8")


def read_marker(folder: Path) -> str | None:
    """The run id in ``folder``'s marker, or None where there is no readable marker (a link never counts)."""
    path = folder / MARKER_FILE
    try:
        if path.is_symlink() or not path.is_file():
            return None
        with path.open("rb") as handle:
            text = handle.read(MARKER_MAX_BYTES).decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    return text if RUN_ID.fullmatch(text) else None


@dataclass(frozen=True)
class Entry:
    """One entry at the top of a run folder: its name and what it is (a link is never followed)."""

    name: str
    kind: Kind


@dataclass(frozen=True)
class RemovalPlan:
    """What deleting a run removes (TuneDeck's entries, the marker last) and what it leaves, with the reason."""

    remove: tuple[str, ...]
    keep: tuple[tuple[str, str], ...]
    marker: MarkerState


def own_kind(name: str) -> Kind | None:
    """The kind of entry a run writes under ``name`` ("file" or "folder"), or None for a name it never writes."""
    for prefix in TEMPORARY_PREFIXES:
        if name.startswith(prefix) and name != prefix:
            name = name[len(prefix) :]
            break
    if name in RUN_FILES:
        return "file"
    if name in RUN_FOLDERS:
        return "folder"
    return None


def why_kept(entry: Entry) -> str | None:
    """Why deleting a run leaves ``entry``, or None when the entry is TuneDeck's to remove."""
    if entry.kind == "link":
        return "a link, which TuneDeck never makes (left, and not followed)"
    wanted = own_kind(entry.name)
    if wanted is None:
        return "not written by TuneDeck"
    if entry.kind != wanted:
        return f"a {entry.kind} where TuneDeck writes a {wanted}"
    return None


def plan_removal(entries: Iterable[Entry], marker: str | None, run_id: str) -> RemovalPlan:
    """Deleting run ``run_id`` from a folder holding ``entries`` whose marker reads ``marker``."""
    remove: list[str] = []
    keep: list[tuple[str, str]] = []
    for entry in sorted(entries, key=lambda e: (e.name == MARKER_FILE, e.name)):  # the marker goes last
        reason = why_kept(entry)
        if reason is None:
            remove.append(entry.name)
        else:
            keep.append((entry.name, reason))
    state: MarkerState = "missing" if marker is None else "matches" if marker == run_id else "other run"
    return RemovalPlan(tuple(remove), tuple(keep), state)


@dataclass(frozen=True)
class FolderRemoval:
    """What deleting a run did to its folder."""

    folder: str
    removed: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]
    folder_removed: bool
    marker: MarkerState

    def lines(self) -> list[str]:
        """The outcome in words: what was removed, what was left and why."""
        why = {
            "matches": "",
            "missing": f"it has no {MARKER_FILE} marker (a run from before TuneDeck marked its folders), so only "
            "TuneDeck's own files were removed",
            "other run": f"its {MARKER_FILE} marker names another run, so only TuneDeck's own files were removed",
        }[self.marker]
        if self.folder_removed:
            return [f"deleted the folder {self.folder}" + (f" ({why}, which left it empty)" if why else "")]
        lines = [f"removed TuneDeck's files from {self.folder}: {', '.join(self.removed) or 'none'}"]
        if why:
            lines.append(f"{why[:1].upper()}{why[1:]}.")
        lines.append(f"left the folder and {len(self.kept)} entr{'y' if len(self.kept) == 1 else 'ies'} in it:")
        lines += [f"  {name}: {reason}" for name, reason in self.kept]
        return lines


def _kind(entry: os.DirEntry[str]) -> Kind:
    if entry.is_symlink() or _is_junction(entry.path):
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "folder"
    return "file" if entry.is_file(follow_symlinks=False) else "other"


def _is_junction(path: str) -> bool:
    isjunction = getattr(os.path, "isjunction", None)  # Windows junctions are links too (Python 3.12+ names them)
    return bool(isjunction(path)) if isjunction is not None else False


def read_entries(folder: Path) -> list[Entry]:
    with os.scandir(folder) as found:
        return [Entry(entry.name, _kind(entry)) for entry in found]


def check_deletable(folder: Path) -> None:
    """Refuse a folder reached through a link (its real place is elsewhere) or with no sign of a TuneDeck run."""
    if folder.is_symlink() or _is_junction(str(folder)) or folder.resolve() != folder.absolute():
        raise RunFolderError(
            f"{folder} is reached through a symbolic link; not deleting from it",
            hint="delete the run with --keep-folder and remove the folder by hand",
        )
    if read_marker(folder) is None and not (folder / "config.json").is_file():
        raise RunFolderError(
            f"{folder} does not look like a run folder (no config.json, no {MARKER_FILE}); not deleting it",
            hint="delete the run with --keep-folder to forget it only",
        )


def remove_run_folder(folder: Path, run_id: str) -> FolderRemoval:
    """Delete run ``run_id``'s entries from ``folder``, and the folder when nothing else is left in it."""
    check_deletable(folder)
    plan = plan_removal(read_entries(folder), read_marker(folder), run_id)
    failed: list[tuple[str, str]] = []
    removed: list[str] = []
    for name in plan.remove:
        path = folder / name
        try:
            if path.is_symlink() or not path.is_dir():  # changed since it was read: a link is only unlinked
                path.unlink()
            else:
                shutil.rmtree(path)  # never follows a link inside (and refuses a link, which this is not)
            removed.append(name)
        except OSError as err:
            failed.append((name, f"could not be removed: {err.strerror or err}"))
    if failed:
        names = ", ".join(f"{name} ({reason})" for name, reason in failed)
        raise RunFolderError(f"cannot delete everything TuneDeck wrote in {folder}: {names}")
    gone = not plan.keep and _remove_empty(folder)
    return FolderRemoval(str(folder), tuple(removed), plan.keep, gone, plan.marker)


def _remove_empty(folder: Path) -> bool:
    try:
        folder.rmdir()  # fails where an entry appeared meanwhile: the folder then stays
    except OSError:
        return False
    return True
