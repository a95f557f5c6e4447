"""The run registry: every run's settings, status and summary in one SQLite database in the user's data folder.

Run folders hold the truth about a run (config, metrics, checkpoints, adapter); the registry is the index the
runs view, the chat and the export commands read, so they need not scan folders. It is written by whoever drives
a run (the app's worker, ``tunedeck train``), possibly several processes at once: WAL mode lets readers work while
one process writes, and a busy timeout makes writers queue instead of failing with "database is locked".

A crash cannot finish a record, so a record says who writes it (pid, its start time, host) and when it last
wrote (heartbeat). A "running" or "paused" run whose writer is gone reads as "interrupted": it can be resumed from
its last checkpoint. engine.run.recorder keeps a record up to date by watching a run's events, so the training
loop itself knows nothing of the registry.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import data_dir as data_dir  # re-exported: callers read the data folder from here
from engine.config import run_name_problem
from engine.errors import TuneDeckError
from engine.run.ownership import FolderRemoval, RunFolderError, new_run_id, read_marker, remove_run_folder

DB_FILE = "runs.sqlite3"
STATUSES = ("running", "paused", "finished", "failed", "interrupted")
ACTIVE = ("running", "paused")
BUSY_TIMEOUT_S = 30.0
# Another host's writer cannot be checked by pid; a heartbeat older than this means it is gone. Paused runs and
# long steps stay under it because the writer refreshes the heartbeat at least this often (see engine.run.recorder).
STALE_AFTER_S = 15 * 60.0

# Each entry moves the schema from version i to i + 1; PRAGMA user_version holds the current version.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        folder TEXT NOT NULL UNIQUE,
        model TEXT NOT NULL DEFAULT '',
        dataset TEXT NOT NULL DEFAULT '',
        config TEXT NOT NULL DEFAULT '{}',
        status TEXT NOT NULL,
        hardware TEXT NOT NULL DEFAULT '{}',
        speed TEXT NOT NULL DEFAULT '{}',
        steps INTEGER NOT NULL DEFAULT 0,
        total_steps INTEGER NOT NULL DEFAULT 0,
        final_loss REAL,
        eval_loss REAL,
        tokens_per_s REAL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        pid INTEGER,
        host TEXT,
        heartbeat REAL
    );
    CREATE INDEX runs_created ON runs (created);
    """,
    """
    ALTER TABLE runs ADD COLUMN pid_started REAL;
    ALTER TABLE runs ADD COLUMN message TEXT;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


class RegistryError(TuneDeckError):
    """The registry cannot be opened or a run cannot be found."""


def default_db_path() -> Path:
    return data_dir() / DB_FILE


@dataclass
class RunRecord:
    """One row of the registry, with JSON columns decoded and the status as the user should see it."""

    id: str
    name: str
    folder: str
    model: str
    dataset: str
    config: dict[str, Any]
    status: str
    hardware: dict[str, Any]
    speed: dict[str, Any]
    steps: int
    total_steps: int
    final_loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None
    created: float
    updated: float
    pid: int | None = None
    host: str | None = None
    heartbeat: float | None = None
    pid_started: float | None = None
    message: str | None = None
    stored_status: str = field(default="", repr=False)

    @property
    def resumable(self) -> bool:
        return self.status == "interrupted" and (Path(self.folder) / "checkpoints").is_dir()


_JSON_COLUMNS = ("config", "hardware", "speed")


def process_started(pid: int) -> float | None:
    """The start time of process ``pid`` (None if it does not exist); with the pid it names a process uniquely."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def writer_alive(record: RunRecord, now: float | None = None) -> bool:
    """Whether the process that writes ``record`` still runs (checked by pid on this host, else by heartbeat)."""
    if record.host == socket.gethostname() and record.pid is not None:
        started = process_started(record.pid)
        if started is None:
            return False
        # A reused pid belongs to a process that started after ours did.
        return record.pid_started is None or abs(started - record.pid_started) < 1.0
    beat = record.heartbeat or record.updated
    return (now or time.time()) - beat < STALE_AFTER_S


class Registry:
    """The runs database. Each call opens its own short connection, so one object serves any thread."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._migrate()

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)) as conn:
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            yield conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that takes the lock up front, so two writers queue rather than deadlock."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _migrate(self) -> None:
        try:
            with self._connect() as conn:
                conn.execute("PRAGMA journal_mode = WAL")
            with self._write() as conn:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise RegistryError(
                        f"the run registry {self.path} was written by a newer TuneDeck (schema {version})",
                        hint="update TuneDeck, or set TUNEDECK_HOME to use another data folder",
                    )
                for index in range(version, SCHEMA_VERSION):
                    for statement in _statements(MIGRATIONS[index]):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {index + 1}")
        except sqlite3.DatabaseError as err:
            raise RegistryError(f"cannot open the run registry {self.path}: {err}") from err

    def schema_version(self) -> int:
        with self._connect() as conn:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])

    # ------------------------------------------------------------------------------------------- writing

    def upsert(self, folder: str | Path, **values: Any) -> str:
        """Create or update the record of the run in ``folder``; returns its id."""
        folder = str(Path(folder).resolve())
        now = time.time()
        row = {k: json.dumps(v) if k in _JSON_COLUMNS else v for k, v in values.items()}
        row["updated"] = now
        with self._write() as conn:
            found = conn.execute("SELECT id FROM runs WHERE folder = ?", (folder,)).fetchone()
            if found is not None:
                _update(conn, found["id"], row)
                return str(found["id"])
            run_id = _id_for(conn, Path(folder))
            row.setdefault("name", Path(folder).name)
            row.setdefault("status", "running")
            columns = {"id": run_id, "folder": folder, "created": now, **row}
            names = ", ".join(columns)
            marks = ", ".join("?" for _ in columns)
            conn.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", tuple(columns.values()))
            return run_id

    def update(self, run_id: str, **values: Any) -> None:
        row = {k: json.dumps(v) if k in _JSON_COLUMNS else v for k, v in values.items()}
        row["updated"] = time.time()
        with self._write() as conn:
            _update(conn, run_id, row)

    def rename(self, run_id: str, name: str) -> None:
        """Give a run a new name (its folder keeps its own); the name follows the rules of a run folder's name."""
        problem = run_name_problem(name.strip())
        if problem is not None:
            raise RegistryError(f"the run name {name.strip()!r} {problem}")
        self.update(run_id, name=name.strip())

    def delete(self, run_id: str, *, remove_folder: bool = True) -> FolderRemoval | None:
        """Forget a run and (by default) delete what TuneDeck wrote in its folder (engine.run.ownership): the
        folder goes only when nothing else is in it. Returns what happened to the folder (None: left alone). A run
        that is still being written is refused."""
        record = self.get(run_id)
        if record.status in ACTIVE:
            raise RegistryError(f"run {record.name} is still {record.status}", hint="stop it first")
        folder = Path(record.folder)
        removal = None
        if remove_folder and (folder.is_dir() or folder.is_symlink()):
            try:
                removal = remove_run_folder(folder, record.id)
            except RunFolderError as err:
                raise RegistryError(err.message, err.hint) from err
            except OSError as err:
                raise RegistryError(f"cannot delete from {folder}: {err.strerror or err}") from err
        with self._write() as conn:
            conn.execute("DELETE FROM runs WHERE id = ?", (run_id,))
        return removal

    # ------------------------------------------------------------------------------------------- reading

    def runs(self) -> list[RunRecord]:
        """Every run, newest first, with dead writers' runs shown as interrupted."""
        with self._connect() as conn:
            rows = conn.execute("SELECT * FROM runs ORDER BY created DESC").fetchall()
        return [_record(row) for row in rows]

    def get(self, run_id: str) -> RunRecord:
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise RegistryError(f"no run with id {run_id}")
        return _record(row)

    def find_folder(self, folder: str | Path) -> RunRecord | None:
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM runs WHERE folder = ?", (str(Path(folder).resolve()),)).fetchone()
        return _record(row) if row is not None else None

    def resolve(self, ref: str) -> RunRecord:
        """A run by folder path, id, name or unique id prefix (what ``tunedeck runs show RUN`` accepts)."""
        if Path(ref).is_dir():
            found = self.find_folder(ref)
            if found is not None:
                return found
        records = self.runs()
        for match in (
            [r for r in records if r.id == ref],
            [r for r in records if r.name == ref],
            [r for r in records if r.id.startswith(ref)] if len(ref) >= 4 else [],
        ):
            if len(match) == 1:
                return match[0]
            if len(match) > 1:
                raise RegistryError(f"'{ref}' names {len(match)} runs", hint="use the run id (tunedeck runs list)")
        raise RegistryError(f"no run '{ref}' in the registry", hint="tunedeck runs list shows the runs")


def _id_for(conn: sqlite3.Connection, folder: Path) -> str:
    """A new record's id: the one in the folder's marker (written as TuneDeck created it), unless another record
    holds it (a copied folder), then a fresh one."""
    marked = read_marker(folder)
    if marked is not None and conn.execute("SELECT 1 FROM runs WHERE id = ?", (marked,)).fetchone() is None:
        return marked
    return new_run_id()


def _statements(script: str) -> list[str]:
    return [part.strip() for part in script.split(";") if part.strip()]


def _update(conn: sqlite3.Connection, run_id: str, row: dict[str, Any]) -> None:
    assignments = ", ".join(f"{name} = ?" for name in row)
    conn.execute(f"UPDATE runs SET {assignments} WHERE id = ?", (*row.values(), run_id))


def _record(row: sqlite3.Row) -> RunRecord:
    values = {key: row[key] for key in row.keys()}  # noqa: SIM118 (sqlite3.Row is not a mapping)
    for key in _JSON_COLUMNS:
        values[key] = json.loads(values[key] or "{}")
    record = RunRecord(**values, stored_status=values["status"])
    if record.status in ACTIVE and not writer_alive(record):
        record.status = "interrupted"
    return record
