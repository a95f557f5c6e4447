"""The run registry: schema migrations, status of runs whose writer died, concurrent writers, recording a run."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hang import HANG_S

from engine.config import RunConfig
from engine.events import CheckpointSaved, RunFinished, RunStarted, StepMetrics
from engine.run.control import RunControl
from engine.run.recorder import recorded
from engine.run.registry import SCHEMA_VERSION, Registry, RegistryError, data_dir
from engine.train import run

REPO = Path(__file__).resolve().parents[1]


def tiny_config(model_dir: Path, data: Path, out: Path, **training: object) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir)},
            "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": 128, "eval_fraction": 0.1},
            "training": {"max_steps": 3, "warmup_steps": 1, "save_every": 2, "eval_every": 2, **training},
            "output": {"dir": str(out), "name": "run"},
        }
    )


def integrity(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


def test_data_dir_follows_override_and_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home"
    monkeypatch.delenv("TUNEDECK_HOME")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "tunedeck"
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert data_dir() == tmp_path / "local" / "TuneDeck"


def test_new_database_is_wal_and_at_the_latest_schema(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "runs.db")
    assert registry.schema_version() == SCHEMA_VERSION
    with sqlite3.connect(registry.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_old_schema_is_migrated_keeping_its_runs(tmp_path: Path) -> None:
    from engine.run.registry import MIGRATIONS

    db = tmp_path / "runs.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(MIGRATIONS[0])
        conn.execute(
            "INSERT INTO runs (id, name, folder, status, created, updated) "
            "VALUES ('abc123', 'old', '/x', 'finished', 1, 1)"
        )
        conn.execute("PRAGMA user_version = 1")
    registry = Registry(db)
    assert registry.schema_version() == SCHEMA_VERSION
    record = registry.get("abc123")
    assert (record.name, record.status, record.message) == ("old", "finished", None)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    Registry(db)
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RegistryError, match="newer TuneDeck"):
        Registry(db)


def test_running_record_of_a_dead_process_reads_as_interrupted(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "runs.db")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    live_id = registry.upsert(tmp_path / "a", status="running", pid=os.getpid(), host=socket.gethostname())
    dead_id = registry.upsert(tmp_path / "b", status="running", pid=dead.pid, host=socket.gethostname())
    far_id = registry.upsert(tmp_path / "c", status="paused", pid=1, host="elsewhere", heartbeat=time.time() - 86400)
    assert registry.get(live_id).status == "running"
    assert registry.get(dead_id).status == "interrupted"
    assert registry.get(far_id).status == "interrupted"
    assert registry.get(dead_id).stored_status == "running"


def test_resolve_by_folder_id_name_and_prefix(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "runs.db")
    (tmp_path / "one").mkdir()
    first = registry.upsert(tmp_path / "one", name="alpha", status="finished")
    registry.upsert(tmp_path / "two", name="beta", status="finished")
    registry.upsert(tmp_path / "three", name="beta", status="finished")
    assert registry.resolve(str(tmp_path / "one")).id == first
    assert registry.resolve(first).id == first
    assert registry.resolve(first[:6]).id == first
    assert registry.resolve("alpha").id == first
    with pytest.raises(RegistryError, match="2 runs"):
        registry.resolve("beta")
    with pytest.raises(RegistryError, match="no run"):
        registry.resolve("gamma")


def test_rename_and_delete_remove_record_and_folder(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "runs.db")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    run_id = registry.upsert(folder, status="finished")
    registry.rename(run_id, "  better name ")
    assert registry.get(run_id).name == "better name"
    registry.delete(run_id)
    assert not folder.exists()
    assert registry.runs() == []


def test_delete_refuses_a_live_run_and_a_foreign_folder(tmp_path: Path) -> None:
    import socket

    registry = Registry(tmp_path / "runs.db")
    live = registry.upsert(tmp_path / "live", status="running", pid=os.getpid(), host=socket.gethostname())
    with pytest.raises(RegistryError, match="still running"):
        registry.delete(live)
    (tmp_path / "photos").mkdir()
    foreign = registry.upsert(tmp_path / "photos", status="finished")
    with pytest.raises(RegistryError, match="does not look like a run folder"):
        registry.delete(foreign)
    assert (tmp_path / "photos").exists()


WRITER = textwrap.dedent(
    """
    import sys, time
    from engine.run.registry import Registry
    registry = Registry(sys.argv[1])
    worker = sys.argv[2]
    ids = [registry.upsert(f"/runs/{worker}-{i}", status="running", model=worker) for i in range(10)]
    for step in range(1, 31):
        for run_id in ids:
            registry.update(run_id, steps=step, final_loss=1.0 / step)
        registry.runs()
    for run_id in ids:
        registry.update(run_id, status="finished")
    print("ok")
    """
)


def test_concurrent_writers_do_not_corrupt_or_lock(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    Registry(db)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(db), f"w{n}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for n in range(4)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=HANG_S)
        assert worker.returncode == 0, err.decode()
        assert out.decode().strip() == "ok"
        assert b"locked" not in err
    records = Registry(db).runs()
    assert len(records) == 40
    assert {(r.status, r.steps) for r in records} == {("finished", 30)}
    assert integrity(db) == "ok"


def test_recorded_run_keeps_events_and_writes_summary(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # both runs train with the same threads, however busy the machine is
    registry = Registry(tmp_path / "runs.db")
    plain = tiny_config(tiny_model_dir, chat_file, tmp_path / "plain")
    watched = tiny_config(tiny_model_dir, chat_file, tmp_path / "watched")
    expected = [(type(e).__name__, getattr(e, "message", "")) for e in run(plain)]
    events = list(recorded(run(watched), registry, name="my first run"))
    assert [(type(e).__name__, getattr(e, "message", "")) for e in events] == expected
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    (record,) = registry.runs()
    assert record.name == "my first run"
    assert record.status == "finished"
    assert record.folder == str(Path(finished.run_dir).resolve())
    assert record.model == str(tiny_model_dir)
    assert record.dataset == str(chat_file)
    assert record.config["training"]["max_steps"] == 3
    assert record.steps == 3
    assert record.final_loss == pytest.approx(finished.final_loss)
    assert record.eval_loss == pytest.approx(finished.eval_loss)
    assert record.tokens_per_s and record.tokens_per_s > 0
    assert record.hardware["device"] == "cpu"
    assert "metadata_cache" in record.speed


def test_stopping_to_read_marks_the_run_interrupted(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    registry = Registry(tmp_path / "runs.db")
    events = recorded(run(tiny_config(tiny_model_dir, chat_file, tmp_path, max_steps=50)), registry)
    for event in events:
        if isinstance(event, StepMetrics):
            break
    events.close()
    (record,) = registry.runs()
    assert record.stored_status == "interrupted"


def test_failed_run_is_recorded_with_its_message(tiny_model_dir: Path, tmp_path: Path) -> None:
    registry = Registry(tmp_path / "runs.db")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    events = list(recorded(run(tiny_config(tiny_model_dir, bad, tmp_path)), registry))
    assert type(events[-1]).__name__ == "RunFailed"
    (record,) = registry.runs()
    assert record.status == "failed"
    assert record.message


CRASHING_RUN = textwrap.dedent(
    """
    import json, sys
    from engine.config import RunConfig
    from engine.run.recorder import recorded
    from engine.run.registry import Registry
    from engine.train import run
    config = RunConfig.from_dict(json.loads(sys.argv[1]))
    for event in recorded(run(config), Registry()):
        print(type(event).__name__, getattr(event, "step", ""), flush=True)
    """
)


def test_killed_run_leaves_a_consistent_interrupted_record_that_resumes(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("TUNEDECK_HOME", str(home))
    config = tiny_config(tiny_model_dir, chat_file, tmp_path / "runs", max_steps=1000, save_every=2, eval_every=0)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RUN, json.dumps(config.to_dict())], env=env, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("CheckpointSaved 4"):
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=HANG_S)
    assert integrity(home / "runs.sqlite3") == "ok"
    (record,) = Registry().runs()
    assert record.stored_status == "running"
    assert record.status == "interrupted"
    assert record.resumable
    logged = len((Path(record.folder) / "metrics.jsonl").read_text(encoding="utf-8").splitlines())
    assert 0 <= record.steps <= logged

    control = RunControl()
    resumed = []
    for event in recorded(run(RunConfig(), control=control, resume=record.folder), Registry()):
        resumed.append(event)
        if isinstance(event, RunStarted):
            assert event.start_step >= 4
            assert Registry().get(record.id).status == "running"
        if isinstance(event, StepMetrics):
            control.stop()
    assert isinstance(resumed[-1], RunFinished) and resumed[-1].cancelled
    assert any(isinstance(e, CheckpointSaved) for e in resumed)
    (after,) = Registry().runs()
    assert (after.id, after.status) == (record.id, "interrupted")
    assert after.steps == resumed[-1].step


def test_runs_command_lists_shows_renames_and_deletes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli.runs import runs_main

    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    assert runs_main(["list"]) == 0
    assert "no runs yet" in capsys.readouterr().out
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    run_id = Registry().upsert(folder, name="first", status="finished", steps=7, total_steps=7, final_loss=0.25)
    assert runs_main([]) == 0
    listing = capsys.readouterr().out
    assert run_id in listing and "first" in listing and "0.2500" in listing and "7/7" in listing
    assert runs_main(["rename", "first", "second"]) == 0
    assert runs_main(["show", run_id[:6], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert (shown["name"], shown["status"], shown["folder"]) == ("second", "finished", str(folder.resolve()))
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert runs_main(["delete", "second"]) == 1
    assert folder.exists()
    assert runs_main(["delete", "second", "--yes"]) == 0
    assert not folder.exists() and Registry().runs() == []
    assert runs_main(["show", "second"]) == 1
    assert "no run 'second'" in capsys.readouterr().err


def test_a_broken_registry_never_stops_the_run(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry(tmp_path / "runs.db")

    def disk_full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Registry, "update", disk_full)
    events = list(recorded(run(tiny_config(tiny_model_dir, chat_file, tmp_path)), registry))
    notices = [e for e in events if type(e).__name__ == "Notice" and "run history" in e.message]
    assert len(notices) == 1 and "disk is full" in notices[0].message
    assert isinstance(events[-1], RunFinished) and not events[-1].cancelled
