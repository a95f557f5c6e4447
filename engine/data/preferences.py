"""Preference pairs a user saves while chatting: a store per base model, and its export as DPO data.

Comparing two answers to one prompt and keeping the better one is the cheapest preference data there is, so the
chat saves each judgement as a pair here, in the user's data folder (``preferences/<model key>.jsonl``). Pairs
are keyed by the *base model* (a run's ``model.name``, a local folder resolved to its absolute path): every run
of one base model adds to and trains from the same file, since a preference says what the user wants of that
model whichever adapter answered; each pair records which run and side produced its answers.

The file is append-only, one JSON object per line, written whole and flushed to disk before ``add`` returns, so
a crash can at most tear the last line: reading skips a line that is not a whole pair, with a notice naming it,
and the next append starts on a fresh line, so no earlier pair is lost. Removing a pair (undo) rewrites the
file atomically. ``export`` writes the pairs in the chat shape ``tunedeck train --method dpo`` reads (a
``prompt`` message list, ``chosen`` and ``rejected`` assistant turns), and every pair is checked by that same
reader when it is added. Nothing here imports torch. The DPO run that trains on the pairs is built in
engine.run.preference_run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import RunConfig, data_dir
from engine.data.files import iter_row_problems
from engine.errors import TuneDeckError

PREFERENCES_DIR = "preferences"
MIN_PAIRS = 4
"""Fewest pairs a DPO run is started on: fewer teach the model little beyond noise."""


class PreferenceError(TuneDeckError):
    """A pair cannot be saved, or there are too few to train on."""


def model_key(model: str) -> str:
    """The file name (without suffix) of ``model``'s pairs: a readable slug and a hash of the full name, so two
    folders both called ``model`` keep separate files and the same model always maps to the same one."""
    name = _canonical_model(model)
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name).name or name).strip("-.") or "model"
    return f"{readable[:60]}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:8]}"


def _canonical_model(model: str) -> str:
    """A local model folder as its absolute path (however it was typed); any other name as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model.strip()


@dataclass(frozen=True)
class SavedPair:
    """One judgement: the conversation up to the answer, the answer kept and the one passed over, and where each
    came from."""

    prompt: tuple[dict[str, str], ...]
    """The messages before the answers ({role, content}), ending with the user's turn."""
    chosen: str
    rejected: str
    chosen_by: str
    """Who wrote the chosen answer, e.g. ``tuned``, ``base``, ``tuned, sample 2``, or ``edited`` text."""
    rejected_by: str
    model: str
    """The base model both answered as (its canonical name)."""
    run: str | None = None
    """The run whose adapter answered: its registry id, or its folder where the registry has none."""
    edited: bool = False
    """Whether the chosen answer is the user's edit of a model's answer."""
    created: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def record(self) -> dict[str, Any]:
        """The line written to the store."""
        return {**dataclasses.asdict(self), "prompt": [dict(m) for m in self.prompt]}

    @classmethod
    def from_record(cls, raw: Any) -> SavedPair:
        """A stored line back as a pair; ValueError when it is not one."""
        if not isinstance(raw, dict):
            raise ValueError(f"not a JSON object but {type(raw).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in ("prompt", "chosen", "rejected", "chosen_by", "rejected_by", "model", "id")
                         if n not in raw)  # fmt: skip
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        values = {key: value for key, value in raw.items() if key in names}
        prompt = values["prompt"]
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            raise ValueError("'prompt' is not a list of messages")
        pair = cls(**{**values, "prompt": tuple(prompt)})
        _check_row(pair.training_row())
        return pair

    def training_row(self) -> dict[str, Any]:
        """The pair as DPO data: the prompt's messages, and each answer as the assistant turn that follows."""
        return {
            "prompt": [dict(m) for m in self.prompt],
            "chosen": [{"role": "assistant", "content": self.chosen}],
            "rejected": [{"role": "assistant", "content": self.rejected}],
        }


def _check_row(row: dict[str, Any]) -> None:
    """Raise a PreferenceError unless the DPO data reader accepts ``row`` (and neither answer is blank)."""
    for key in ("chosen", "rejected"):
        if not str(row[key][0]["content"]).strip():
            raise PreferenceError(f"the {key} answer is empty: nothing to compare")
    for _, name, message in iter_row_problems([row], "preference"):
        raise PreferenceError(f"this pair cannot train a model: {name} {message}")


@dataclass(frozen=True)
class StoredPairs:
    """What reading a store gives: its pairs, oldest first, and a notice for each line that was skipped."""

    pairs: list[SavedPair]
    skipped: list[str]


def last_exchange(
    first: Sequence[dict[str, str]], second: Sequence[dict[str, str]]
) -> tuple[list[dict[str, str]], str, str]:
    """The conversation two chat histories share and each one's last answer to it: what a pair is made of. A
    PreferenceError says why two histories make no pair (an answer missing, or answers to different talks)."""
    if not first or not second or first[-1]["role"] != "assistant":
        raise PreferenceError("ask for two answers to pick the better one")
    if second[-1]["role"] != "assistant":
        raise PreferenceError("only one answer came: ask again for two")
    if list(first[:-1]) != list(second[:-1]):
        raise PreferenceError("the two answers reply to different conversations: pick after each pair, or start anew")
    return [dict(m) for m in first[:-1]], first[-1]["content"], second[-1]["content"]


class PreferenceStore:
    """The saved pairs of one base model: ``<data folder>/preferences/<model key>.jsonl``."""

    def __init__(self, model: str, folder: Path | None = None) -> None:
        self.model = _canonical_model(model)
        self.folder = folder if folder is not None else data_dir() / PREFERENCES_DIR
        self.path = self.folder / f"{model_key(model)}.jsonl"

    @classmethod
    def for_run(cls, run_folder: str | Path, folder: Path | None = None) -> PreferenceStore:
        """The store of the base model a run trained (from its ``config.json``)."""
        return cls(_run_config(Path(run_folder)).model.name, folder)

    @property
    def label(self) -> str:
        """The model as a user would name it: a folder's name, or the name as given."""
        return Path(self.model).name or self.model

    def add(
        self,
        prompt: Sequence[dict[str, str]],
        chosen: str,
        rejected: str,
        *,
        chosen_by: str,
        rejected_by: str,
        run: str | None = None,
        edited: bool = False,
    ) -> SavedPair:
        """Save one pair, on disk before this returns; a pair the DPO reader would refuse is refused here."""
        messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in prompt)
        if not messages:
            raise PreferenceError("a pair needs the prompt its answers reply to")
        pair = SavedPair(messages, chosen, rejected, chosen_by, rejected_by, self.model, run, edited)
        _check_row(pair.training_row())
        self._append(json.dumps(pair.record(), ensure_ascii=False) + "\n")
        return pair

    def _append(self, line: str) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as handle:
                if handle.tell() and not _ends_with_newline(self.path):
                    handle.write(b"\n")  # a torn last line stays a line of its own, skipped when read
                handle.write(line.encode("utf-8"))
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as err:
            raise PreferenceError(f"cannot save the pair to {self.path}: {err.strerror or err}") from err

    def read(self) -> StoredPairs:
        """Every whole pair in the file; a torn or damaged line is skipped and named, never the ones around it."""
        return read_pairs(self.path)

    def pairs(self) -> list[SavedPair]:
        return self.read().pairs

    def count(self) -> int:
        return len(self.read().pairs)

    def remove(self, pair_id: str) -> bool:
        """Take a pair out (undo); False when no pair has that id. The file is replaced atomically."""
        stored = self.read()
        kept = [pair for pair in stored.pairs if pair.id != pair_id]
        if len(kept) == len(stored.pairs):
            return False
        _write_atomic(self.path, "".join(json.dumps(p.record(), ensure_ascii=False) + "\n" for p in kept))
        return True

    def export(self, target: str | Path) -> int:
        """Write the pairs as DPO data (JSONL, one prompt/chosen/rejected row each) to ``target``; the count."""
        pairs = self.pairs()
        if not pairs:
            raise PreferenceError(f"no preferences saved for {self.label} yet: nothing to export")
        _write_atomic(Path(target), "".join(json.dumps(p.training_row(), ensure_ascii=False) + "\n" for p in pairs))
        return len(pairs)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` so that a crash leaves the old file or the new one, never half of one."""
    temporary = path.with_name(f".tmp-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as err:
        raise PreferenceError(f"cannot write {path}: {err.strerror or err}") from err


def read_pairs(path: Path) -> StoredPairs:
    """The pairs of a store file (none when it does not exist yet), skipping and naming lines that are not one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return StoredPairs([], [])
    except OSError as err:
        raise PreferenceError(f"cannot read {path}: {err.strerror or err}") from err
    pairs, skipped = [], []
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            pairs.append(SavedPair.from_record(json.loads(raw.decode("utf-8"))))
        except (ValueError, TypeError, TuneDeckError) as err:
            torn = number == len(lines)  # the last line has no newline: its write was cut off
            reason = "cut off by an interrupted save" if torn else f"not a saved pair ({_first_line(err)})"
            skipped.append(f"{path.name}, line {number}: skipped, {reason}")
    return StoredPairs(pairs, skipped)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def saved_models(folder: Path | None = None) -> list[tuple[str, int]]:
    """Each base model with saved pairs and how many, as (model, count), by model name."""
    root = folder if folder is not None else data_dir() / PREFERENCES_DIR
    counts = [read_pairs(path).pairs for path in sorted(root.glob("*.jsonl"))]
    return sorted((pairs[0].model, len(pairs)) for pairs in counts if pairs)


def _run_config(run_folder: Path) -> RunConfig:
    path = run_folder / "config.json"
    if not path.is_file():
        raise PreferenceError(f"{run_folder} is not a TuneDeck run folder (no config.json)")
    return RunConfig.load(path)


def missing_pairs(count: int) -> str | None:
    """Why ``count`` pairs are too few to train on, in words; None when they are enough."""
    if count >= MIN_PAIRS:
        return None
    more = MIN_PAIRS - count
    return f"save at least {MIN_PAIRS} preferences first ({more} more)"
