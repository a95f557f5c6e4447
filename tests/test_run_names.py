"""Run names and deleting runs: a run name is one plain folder name inside the output folder (the config, the
command line, ``runs rename``), and deleting a run removes only what TuneDeck wrote in its folder.

``tunedeck train --demo --output runs --name ..`` once wrote a run into the current folder, and ``tunedeck runs
delete --yes`` then removed that folder with a file of the user's in it; both are reproduced here as a user would
meet them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
from hang import HANG_S
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.config import RunConfig, run_name_problem
from engine.errors import ConfigError
from engine.run.ownership import (
    MARKER_FILE,
    RUN_FILES,
    RUN_FOLDERS,
    Entry,
    plan_removal,
    read_marker,
    remove_run_folder,
    write_marker,
)
from engine.run.registry import Registry, RegistryError

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ the rule

ACCEPTED = ["my-run", "run 2", "Run_3.v2", ".hidden", "-dash", "über lauf", "実験", "COM0", "CONSOLE", "com10",
            "lpt", "a" * 120, "é" * 120]  # fmt: skip
REFUSED = [
    ("", "is empty"),
    ("   ", "is blank"),
    (".", "output folder itself"),
    ("..", "output folder's parent"),
    ("a/b", "contains '/'"),
    ("/abs", "contains '/'"),
    ("a\\b", "contains '\\\\'"),
    ("C:", "contains ':'"),
    ("C:run", "contains ':'"),
    ("tab\there", "control character"),
    ("nul\x00byte", "control character"),
    ("bell\x7f", "control character"),
    ("half\ud800", "half of a character pair"),
    ("what?", "contains '?'"),
    ("star*", "contains '*'"),
    ("<tag>", "contains '<'"),
    ('say "hi"', "contains '\"'"),
    ("pipe|d", "contains '|'"),
    ("trailing.", "ends with a dot"),
    ("...", "ends with a dot"),
    ("trailing ", "white space"),
    (" leading", "white space"),
    ("CON", "(CON)"),
    ("con", "(CON)"),
    ("Nul.txt", "(NUL)"),
    ("aux.tar.gz", "(AUX)"),
    ("prn", "(PRN)"),
    ("COM1", "(COM1)"),
    ("com9.log", "(COM9)"),
    ("LPT1", "(LPT1)"),
    ("lpt5", "(LPT5)"),
    ("CON .txt", "(CON)"),
    ("conin$", "(CONIN$)"),
    ("COM\u00b9", "(COM\u00b9)"),
    ("a" * 121, "too long"),
    ("é" * 121, "too long"),
    ("語" * 81, "too long"),  # 81 characters, 243 bytes in UTF-8
]


@pytest.mark.parametrize("name", ACCEPTED)
def test_plain_folder_names_are_accepted(name: str) -> None:
    assert run_name_problem(name) is None


@pytest.mark.parametrize(("name", "reason"), REFUSED, ids=[repr(name)[:24] for name, _ in REFUSED])
def test_paths_devices_and_odd_characters_are_refused_with_the_reason(name: str, reason: str) -> None:
    problem = run_name_problem(name)
    assert problem is not None and reason in problem, problem


FRAGMENTS = [".", "..", "/", "\\", ":", " ", "\x00", "\n", "\x1f", "\x85", "CON", "nul", "Com1", "lpt9", "C:", "//",
             "\\\\?\\", "UNC", "~", "$", "%", "é", "\u202e", "\ufeff", "\u3000", "a", "run", ".txt", "*", "?", '"',
             "\ud800"]  # fmt: skip
names = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=8).map("".join) | st.text(max_size=130)


def windows_reserves(path: PureWindowsPath) -> bool:
    """pathlib's own judgement of Windows' device names (deprecated from Python 3.13, where it warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(getattr(path, "is_reserved", lambda: False)())


def is_one_component(name: str) -> bool:
    """Whether ``name`` is one path component, neither . nor .. nor a device, under POSIX's and Windows' rules."""
    windows, posix = PureWindowsPath(name), PurePosixPath(name)
    runs_w, runs_p = PureWindowsPath("C:/Users/me/runs"), PurePosixPath("/home/me/runs")
    return (
        windows.parts == (name,)
        and posix.parts == (name,)
        and (runs_w / name).parent == runs_w
        and (runs_w / name).name == name
        and (runs_p / name).parent == runs_p
        and (runs_p / name).name == name
        and not windows.drive
        and not windows_reserves(windows)
        and name not in (".", "..")
    )


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=names)
@example(name="..")
@example(name="C:evil")
@example(name="a/../..")
@example(name="nul .txt")
def test_every_accepted_name_is_one_folder_directly_inside_the_output_folder(name: str) -> None:
    if run_name_problem(name) is not None:
        return
    assert is_one_component(name), name
    with tempfile.TemporaryDirectory() as parent:
        folder = Path(parent) / name
        assert folder.resolve().parent == Path(parent).resolve()
        folder.mkdir()  # the file system takes it, and it reads back as the same single name
        assert os.listdir(parent) == [name]


@settings(max_examples=300, deadline=None)
@given(model=st.text(max_size=300), data=st.text(max_size=300))
@example(model="ollama:smollm2:135m", data="chats.jsonl")
@example(model="CON", data="nul")
@example(model="..", data="..")
@example(model="語" * 200, data=" data .jsonl")
def test_the_default_run_name_always_passes_the_rule(model: str, data: str) -> None:
    from engine.run.folder import _default_run_name

    config = RunConfig()
    config.model.name, config.data.path = model, data  # any text, as a hand-edited config could hold
    name = _default_run_name(config)
    assert run_name_problem(name) is None, name
    assert run_name_problem(f"{name}-abcd") is None  # with the suffix a clashing default name gets


# --------------------------------------------------------------------------------------- the config file


@pytest.mark.parametrize("name", ["..", "a/b", "CON", "x.", ""])
def test_a_config_file_with_a_bad_run_name_is_refused_naming_the_setting(tmp_path: Path, name: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"output": {"dir": str(tmp_path / "runs"), "name": name}}), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        RunConfig.load(path)
    assert str(path) in caught.value.message and "output.name" in caught.value.message
    assert run_name_problem(name) in caught.value.message  # type: ignore[operator]


@pytest.mark.parametrize("sign", ["metrics.jsonl", "checkpoints", MARKER_FILE])
def test_a_run_saved_before_names_were_checked_still_loads_without_its_name(tmp_path: Path, sign: str) -> None:
    saved = {"output": {"dir": str(tmp_path), "name": "exp/1"}, "training": {"max_steps": 7}}
    folder = tmp_path / "exp" / "1"  # where --name exp/1 put it
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"output\.name"):  # not a run folder yet: the name is judged
        RunConfig.load(folder / "config.json")
    (folder / sign).mkdir() if sign == "checkpoints" else (folder / sign).write_text("", encoding="utf-8")
    config = RunConfig.load(folder / "config.json")
    assert config.output.name is None and config.training.max_steps == 7


def test_no_name_means_the_default_name(tmp_path: Path) -> None:
    assert RunConfig.from_dict({"output": {"name": None}}).output.name is None


# --------------------------------------------------------------------------------------- the command line


def tunedeck(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TUNEDECK_HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=HANG_S
    )


def listing(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def test_the_reported_name_dot_dot_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine\n", encoding="utf-8")
    result = tunedeck("train", "--demo", "--output", "runs", "--name", "..", cwd=work, home=tmp_path / "home")
    assert result.returncode == 2, result.stderr
    assert "output.name: '..' is the output folder's parent" in result.stderr
    assert "Traceback" not in result.stderr
    assert listing(work) == {"notes.txt"}


@pytest.mark.parametrize("name", ["a/b", "../escape", "/tmp/abs", "C:\\runs\\x", "CON", "trailing.", "ctl\x01", ""])
def test_train_refuses_each_bad_name_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    from engine.cli.train import train_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    assert train_main(["--data", "chats.jsonl", "--output", "runs", "--name", name]) == 2
    assert f"output.name: {name!r} {run_name_problem(name)}" in capsys.readouterr().err
    assert listing(tmp_path) == set()


def test_train_refuses_a_bad_name_in_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "mine.json"
    config.write_text(json.dumps({"output": {"dir": "runs", "name": "../.."}}), encoding="utf-8")
    result = tunedeck("train", "--demo", "--config", str(config), cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2 and "output.name" in result.stderr and str(config) in result.stderr
    assert listing(tmp_path) == {"mine.json"}


def test_runs_rename_refuses_a_bad_name_and_keeps_the_old_one(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = tmp_path / "runs" / "first"
    folder.mkdir(parents=True)
    run_id = Registry(home / "runs.sqlite3").upsert(folder, name="first", status="finished")
    for bad in ("..", "a/b", "NUL", "x" * 121):
        result = tunedeck("runs", "rename", run_id, bad, cwd=tmp_path, home=home)
        assert result.returncode == 1 and run_name_problem(bad) in result.stderr, result.stderr  # type: ignore[operator]
    assert Registry(home / "runs.sqlite3").get(run_id).name == "first"
    good = tunedeck("runs", "rename", run_id, "  second try ", cwd=tmp_path, home=home)
    assert good.returncode == 0, good.stderr
    assert Registry(home / "runs.sqlite3").get(run_id).name == "second try"


def train_tiny(model: Path, data: Path, runs: Path, name: str, home: Path) -> Path:
    result = tunedeck(
        "train", "--model", str(model), "--data", str(data), "--output", str(runs), "--name", name,
        "--max-steps", "2", "--save-every", "1", "--data-max-seq-len", "32", "--data-tokens-per-batch", "64",
        "--json", cwd=runs.parent, home=home,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return runs / name


def test_delete_removes_everything_a_real_run_wrote_and_keeps_a_users_file(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    home, runs = tmp_path / "home", tmp_path / "runs"
    folder = train_tiny(tiny_model_dir, chat_file, runs, "mine", home)
    (record,) = Registry(home / "runs.sqlite3").runs()
    assert read_marker(folder) == record.id, "the marker holds the id the run history gave the run"
    written = {path.name for path in folder.iterdir()}
    assert {"config.json", "metrics.jsonl", "checkpoints", "adapter", "report.md", MARKER_FILE} <= written
    assert written <= RUN_FILES | RUN_FOLDERS, f"the run wrote entries delete does not know: {written}"
    (folder / "notes.txt").write_text("my notes\n", encoding="utf-8")
    (folder / "photos").mkdir()
    (folder / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    deleted = tunedeck("runs", "delete", "--yes", "mine", cwd=tmp_path, home=home)
    assert deleted.returncode == 0, deleted.stderr
    assert listing(folder) == {"notes.txt", "photos", "photos/cat.jpg"}, "everything the run wrote is gone"
    assert (folder / "notes.txt").read_text(encoding="utf-8") == "my notes\n"
    assert "notes.txt: not written by TuneDeck" in deleted.stdout
    assert "photos: not written by TuneDeck" in deleted.stdout
    assert "left the folder and 2 entries in it" in deleted.stdout
    assert Registry(home / "runs.sqlite3").runs() == []


def test_the_reported_delete_of_a_run_written_into_the_users_folder_keeps_the_users_file(tmp_path: Path) -> None:
    """A run from before names were checked: recorded with the user's folder as its run folder, no marker."""
    home, work = tmp_path / "home", tmp_path / "work"
    (work / "checkpoints" / "step-000002").mkdir(parents=True)
    (work / "adapter").mkdir()
    (work / "adapter" / "adapter_config.json").write_text("{}", encoding="utf-8")
    for name in ("config.json", "metrics.jsonl", "eval.jsonl", "report.md", "report.json"):
        (work / name).write_text("{}\n", encoding="utf-8")
    (work / "thesis.tex").write_text("three years of work\n", encoding="utf-8")
    Registry(home / "runs.sqlite3").upsert(work, name="oops", status="finished")
    result = tunedeck("runs", "delete", "--yes", "oops", cwd=tmp_path, home=home)
    assert result.returncode == 0, result.stderr
    assert listing(work) == {"thesis.tex"}
    assert (work / "thesis.tex").read_text(encoding="utf-8") == "three years of work\n"
    assert f"no {MARKER_FILE} marker" in result.stdout and "thesis.tex: not written by TuneDeck" in result.stdout


# ------------------------------------------------------------------------------------------- the decision


def entries(*specs: str) -> list[Entry]:
    """'name' for a file, 'name/' for a folder, 'name@' for a link."""
    kinds = {"/": "folder", "@": "link"}
    return [Entry(spec.rstrip("/@"), kinds.get(spec[-1], "file")) for spec in specs]  # type: ignore[arg-type]


PLANS = [
    # entries, marker, removed (marker last), kept names, marker state
    (["config.json", "metrics.jsonl", "checkpoints/", "adapter/", MARKER_FILE], "aaaaaaaaaaaa",
     ("adapter", "checkpoints", "config.json", "metrics.jsonl", MARKER_FILE), (), "matches"),
    (["config.json", "notes.txt", "photos/", MARKER_FILE], "aaaaaaaaaaaa",
     ("config.json", MARKER_FILE), ("notes.txt", "photos"), "matches"),
    (["config.json", "adapter/"], None, ("adapter", "config.json"), (), "missing"),
    (["config.json", MARKER_FILE], "bbbbbbbbbbbb", ("config.json", MARKER_FILE), (), "other run"),
    (["adapter@", "config.json", "report.md@"], "aaaaaaaaaaaa", ("config.json",), ("adapter", "report.md"), "matches"),
    (["config.json/", "checkpoints", "eval.jsonl"], None, ("eval.jsonl",), ("checkpoints", "config.json"), "missing"),
    ([".tmp-adapter/", ".old-checkpoints/", ".tmp-config.json", ".trash-adapter-best/", ".tmp-photos/", ".tmp-"],
     None, (".old-checkpoints", ".tmp-adapter", ".tmp-config.json", ".trash-adapter-best"), (".tmp-", ".tmp-photos"),
     "missing"),
    (["Config.json", "ADAPTER/", "config.json.bak"], None, (), ("ADAPTER", "Config.json", "config.json.bak"),
     "missing"),
]  # fmt: skip


@pytest.mark.parametrize(("specs", "marker", "removed", "kept", "state"), PLANS)
def test_plan_removes_only_what_tunedeck_writes(
    specs: list[str], marker: str | None, removed: tuple[str, ...], kept: tuple[str, ...], state: str
) -> None:
    plan = plan_removal(entries(*specs), marker, "aaaaaaaaaaaa")
    assert plan.remove == removed
    assert tuple(name for name, _ in plan.keep) == kept
    assert plan.marker == state


def test_the_known_entries_are_the_names_the_run_code_writes() -> None:
    from engine.distributed.control import CONTROL_FILE
    from engine.run import folder
    from engine.run.report import REPORT_JSON, REPORT_MD

    files = {folder.CONFIG_FILE, folder.METRICS_FILE, folder.EVAL_FILE, folder.MEMORY_FILE, folder.COMPUTE_FILE,
             REPORT_JSON, REPORT_MD, CONTROL_FILE, MARKER_FILE}  # fmt: skip
    assert files <= RUN_FILES
    assert {folder.CHECKPOINT_DIR, folder.ADAPTER_DIR, folder.BEST_ADAPTER_DIR} <= RUN_FOLDERS


def test_the_error_log_is_a_known_file(tmp_path: Path) -> None:
    from engine.run.folder import write_error_log

    log = write_error_log(tmp_path, RuntimeError("boom"))
    assert log is not None and log.name in RUN_FILES


# ------------------------------------------------------------------------------------- deleting on disk


def run_folder(root: Path, run_id: str | None = "aaaaaaaaaaaa") -> Path:
    folder = root / "runs" / "r"
    (folder / "checkpoints" / "step-000001").mkdir(parents=True)
    (folder / "checkpoints" / "step-000001" / "adapter.safetensors").write_bytes(b"w")
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_config.json").write_text("{}", encoding="utf-8")
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n', encoding="utf-8")
    if run_id is not None:
        write_marker(folder, run_id)
    return folder


def test_a_marked_folder_of_only_run_files_is_deleted(tmp_path: Path) -> None:
    folder = run_folder(tmp_path)
    removal = remove_run_folder(folder, "aaaaaaaaaaaa")
    assert removal.folder_removed and not folder.exists()
    assert removal.lines() == [f"deleted the folder {folder}"]


def test_a_folder_without_the_marker_loses_only_run_files_and_says_so(tmp_path: Path) -> None:
    folder = run_folder(tmp_path, run_id=None)
    removal = remove_run_folder(folder, "aaaaaaaaaaaa")
    assert removal.folder_removed and not folder.exists()
    assert "no .tunedeck-run marker" in removal.lines()[0] and "left it empty" in removal.lines()[0]
    folder = run_folder(tmp_path, run_id=None)
    (folder / "notes.txt").write_text("mine", encoding="utf-8")
    removal = remove_run_folder(folder, "aaaaaaaaaaaa")
    assert listing(folder) == {"notes.txt"}
    assert any("no .tunedeck-run marker" in line for line in removal.lines())


def test_another_runs_marker_keeps_what_is_not_tunedecks(tmp_path: Path) -> None:
    folder = run_folder(tmp_path, run_id="bbbbbbbbbbbb")
    (folder / "mine").mkdir()
    removal = remove_run_folder(folder, "aaaaaaaaaaaa")
    assert listing(folder) == {"mine"} and not removal.folder_removed
    assert any("marker names another run" in line for line in removal.lines())
    assert "  mine: not written by TuneDeck" in removal.lines()


def test_a_folder_with_no_sign_of_a_run_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("mine", encoding="utf-8")
    registry = Registry(tmp_path / "runs.db")
    run_id = registry.upsert(folder, status="finished")
    with pytest.raises(RegistryError, match="does not look like a run folder"):
        registry.delete(run_id)
    assert listing(folder) == {"metrics.jsonl"} and registry.get(run_id)


@pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges on Windows")
def test_links_are_never_followed_out_of_the_run_folder(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious", encoding="utf-8")
    folder = run_folder(tmp_path)
    (folder / "adapter-best").symlink_to(outside, target_is_directory=True)  # a known name, as a link
    (folder / "checkpoints" / "step-000002").symlink_to(outside, target_is_directory=True)  # a link in a run folder
    (folder / "report.md").symlink_to(outside / "keep.txt")
    removal = remove_run_folder(folder, "aaaaaaaaaaaa")
    assert (outside / "keep.txt").read_text(encoding="utf-8") == "precious"
    assert listing(outside) == {"keep.txt"}
    assert {path.name for path in folder.iterdir()} == {"adapter-best", "report.md"}
    assert (folder / "adapter-best").is_symlink() and not removal.folder_removed
    assert dict(removal.kept)["report.md"].startswith("a link")


@pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges on Windows")
def test_a_run_folder_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    real = run_folder(tmp_path)
    registry = Registry(tmp_path / "runs.db")
    run_id = registry.upsert(real, status="finished")
    moved = tmp_path / "elsewhere"
    real.rename(moved)
    real.symlink_to(moved, target_is_directory=True)  # the recorded folder is now a link to another place
    with pytest.raises(RegistryError, match="symbolic link"):
        registry.delete(run_id)
    assert (moved / "config.json").exists() and registry.get(run_id)
    real.unlink()
    moved.rename(real)
    (tmp_path / "runs").rename(tmp_path / "runs-real")
    (tmp_path / "runs").symlink_to(tmp_path / "runs-real", target_is_directory=True)  # a link above the folder
    with pytest.raises(RegistryError, match="symbolic link"):
        registry.delete(run_id)


# ------------------------------------------------------------------------------------------ new run folders


def test_a_new_run_folder_is_marked_and_recorded_under_the_markers_id(tmp_path: Path) -> None:
    from engine.run.folder import new_run_dir

    config = RunConfig.from_dict({"output": {"dir": str(tmp_path / "runs"), "name": "mine"}})
    folder = new_run_dir(config)
    assert folder == tmp_path / "runs" / "mine"
    marker = read_marker(folder)
    assert marker is not None and (folder / MARKER_FILE).read_text(encoding="utf-8") == marker + "\n"
    registry = Registry(tmp_path / "runs.db")
    assert registry.upsert(folder, status="finished") == marker
    copy = tmp_path / "runs" / "copy"
    copy.mkdir()
    write_marker(copy, marker)  # a copied folder: its marker's id is taken, so it gets its own id
    assert registry.upsert(copy, status="finished") != marker


@pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges on Windows")
def test_a_run_name_that_is_a_link_out_of_the_output_folder_is_refused(tmp_path: Path) -> None:
    from engine.run.folder import new_run_dir

    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mine").symlink_to(home, target_is_directory=True)
    config = RunConfig.from_dict({"output": {"dir": str(tmp_path / "runs"), "name": "mine"}})
    with pytest.raises(ConfigError, match="outside the output folder"):
        new_run_dir(config)
    assert listing(home) == set()


def test_a_hand_built_config_with_a_bad_name_writes_nothing(tmp_path: Path) -> None:
    from engine.run.folder import new_run_dir

    config = RunConfig.from_dict({"output": {"dir": str(tmp_path / "runs" / "inner")}})
    config.output.name = ".."  # past OutputConfig's check, as code that sets a field afterwards would be
    with pytest.raises(ConfigError, match=re.escape("output.name: '..'")):
        new_run_dir(config)
    assert listing(tmp_path) == set()
