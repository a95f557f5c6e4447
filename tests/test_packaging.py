"""The installers: packaging/build makes them, they look right, and the Linux one installs offline and runs.

The build needs makensis (Debian: nsis), dpkg-deb and desktop-file-validate (desktop-file-utils); each check
skips with the reason when its tool is missing. uv's binaries come from PyPI during the build.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hang import HANG_S

from engine.setup.cancel import CancelToken
from engine.setup.environment import READY, InstallLayout, swap_in_staging
from engine.setup.events import Progress, SetupCancelled, SetupEvent
from engine.setup.uv_process import run_uv
from engine.setup.wheelhouse import installed_distributions, repack

REPO = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"


def needs(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (Debian: apt-get install nsis desktop-file-utils dpkg)")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dist")
    only = [
        f"--only={kind}"
        for kind, tool in (("exe", "makensis"), ("tar", "tar"), ("deb", "dpkg-deb"))
        if shutil.which(tool)
    ]
    result = subprocess.run(
        [sys.executable, str(REPO / "packaging" / "build"), "--dist", str(folder), "--quick", *only],
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return folder


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV", "XDG_", "PIP_", "TUNEDECK_"))}
    return {**env, "QT_QPA_PLATFORM": "offscreen", **extra}


# ------------------------------------------------------------------------------------------------- artifacts


def test_windows_installer_is_an_nsis_pe(dist: Path) -> None:
    needs("makensis")
    exe = dist / f"TuneDeck-Setup-{VERSION}.exe"
    data = exe.read_bytes()
    assert data[:2] == b"MZ"
    pe_offset = int.from_bytes(data[0x3C:0x40], "little")
    assert data[pe_offset : pe_offset + 4] == b"PE\0\0"
    assert b"Nullsoft" in data or b"NullsoftInst" in data
    assert 2_000_000 < len(data) < 40_000_000  # uv.exe and the wheel inside, no torch


def test_a_release_build_compresses_the_windows_installer_with_lzma() -> None:
    """The tests build with ``--quick`` (zlib, seconds); a release build and a plain makensis run use LZMA."""
    script = (REPO / "packaging" / "windows" / "tunedeck.nsi").read_text(encoding="utf-8")
    assert "!define COMPRESSOR lzma" in script and "SetCompressor /SOLID ${COMPRESSOR}" in script
    assert inspect.signature(build_script().build_exe).parameters["compressor"].default == "lzma"


def test_linux_archive_has_launcher_desktop_entry_and_icon(dist: Path, tmp_path: Path) -> None:
    archive = dist / f"tunedeck-{VERSION}-linux-x86_64.tar.gz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path, filter="data")
    top = f"tunedeck-{VERSION}-linux-x86_64"
    for name in ("install.sh", "tunedeck", "uninstall.sh", "uv", "tunedeck.desktop", "tunedeck.png"):
        assert f"{top}/{name}" in names
        if name in ("install.sh", "tunedeck", "uv"):
            assert os.access(tmp_path / top / name, os.X_OK)
    assert (tmp_path / top / "tunedeck.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((tmp_path / top / "wheels").glob("tunedeck-*.whl"))) == 1
    needs("desktop-file-validate")
    check = subprocess.run(
        ["desktop-file-validate", str(tmp_path / top / "tunedeck.desktop")], capture_output=True, text=True
    )
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def test_deb_metadata_and_files(dist: Path, tmp_path: Path) -> None:
    needs("dpkg-deb")
    deb = dist / f"tunedeck_{VERSION}_amd64.deb"
    fields = {}
    for field in ("Package", "Version", "Architecture", "Installed-Size", "Description"):
        fields[field] = subprocess.run(
            ["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True
        ).stdout.strip()
    assert (fields["Package"], fields["Version"], fields["Architecture"]) == ("tunedeck", VERSION, "amd64")
    assert int(fields["Installed-Size"]) > 1000 and "NVIDIA" in fields["Description"]
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    for path in ("./opt/tunedeck/uv", "./opt/tunedeck/tunedeck", "./opt/tunedeck/install.sh", "./usr/bin/tunedeck",
                 "./usr/share/applications/tunedeck.desktop", "./usr/share/icons/hicolor/256x256/apps/tunedeck.png",
                 f"./opt/tunedeck/wheels/tunedeck-{VERSION}-py3-none-any.whl"):  # fmt: skip
        assert path in listing
    assert "root/root" in listing
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True)
    needs("desktop-file-validate")
    desktop = tmp_path / "usr" / "share" / "applications" / "tunedeck.desktop"
    assert subprocess.run(["desktop-file-validate", str(desktop)], capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------------ offline install


def base_python() -> str:
    """This machine's Python (not the test venv): uv would download one on a user's machine."""
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def run(argv: list[str], env: dict[str, str], timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, f"{argv}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_linux_archive_installs_offline_and_runs(dist: Path, tmp_path: Path) -> None:
    """Unpack into a HOME with spaces, install from a wheelhouse with no network, start TuneDeck, repair."""
    home = tmp_path / "home with spaces"
    home.mkdir()
    with tarfile.open(dist / f"tunedeck-{VERSION}-linux-x86_64.tar.gz") as tar:
        tar.extractall(home / "Downloads", filter="data")
    unpacked = home / "Downloads" / f"tunedeck-{VERSION}-linux-x86_64"
    wheelhouse = tmp_path / "wheel house"
    env = clean_env(HOME=str(home), UV_OFFLINE="1")
    # The wheelhouse of this test environment: what "Export wheelhouse" gives a user (torch's wheel is copied
    # from pip's local wheel folder when it is there, rebuilt from the installed files otherwise).
    export = [sys.executable, "-m", "engine.setup", "export-wheelhouse", str(wheelhouse), "--search", "/opt/wheels"]
    run(export, clean_env())
    assert list(wheelhouse.glob("torch-*.whl"))

    installed = run([str(unpacked / "install.sh"), "--wheelhouse", str(wheelhouse), "--python", base_python()], env)
    assert "without network" in installed.stdout
    root = home / ".local" / "share" / "tunedeck"
    assert (root / "env" / READY).is_file() and (root / "cache" / "uv").is_dir()
    launcher = home / ".local" / "bin" / "tunedeck"
    assert run([str(launcher), "--version"], env).stdout.strip() == f"tunedeck {VERSION}"

    marker = json.loads((root / "tunedeck-install.json").read_text())
    assert marker["version"] == VERSION and marker["torch_build"] == "wheelhouse"
    check = run([str(root / "env" / "bin" / "python"), "-m", "engine.setup", "check", "--root", str(root)], env)
    assert "torch 2." in check.stdout

    desktop = home / ".local" / "share" / "applications" / "tunedeck.desktop"
    assert f'Exec="{root}/tunedeck" --gui' in desktop.read_text()
    if shutil.which("desktop-file-validate"):
        assert subprocess.run(["desktop-file-validate", str(desktop)], capture_output=True).returncode == 0

    # Qt starts offscreen from the installed environment, and the app package loads without torch.
    qt = (
        "import sys\nfrom PySide6.QtWidgets import QApplication, QLabel\nimport app\n"
        "q = QApplication([])\nw = QLabel('TuneDeck')\nw.show()\nq.processEvents()\n"
        "assert 'torch' not in sys.modules\nprint(q.platformName())\n"
    )
    assert run([str(root / "env" / "bin" / "python"), "-c", qt], env).stdout.strip() == "offscreen"

    repaired = run([str(launcher), "--version"], env)  # launcher still fine before repair
    repair = [str(root / "env" / "bin" / "python"), "-m", "engine.setup", "repair", "--root", str(root),
              "--wheelhouse", str(wheelhouse), "--python", base_python()]  # fmt: skip
    (root / "env" / "lib").rename(root / "env" / "lib-broken")  # break the environment
    repaired = run(repair, env)
    assert "environment rebuilt" in repaired.stdout
    assert not (root / "env.new").exists() and not (root / "env" / "lib-broken").exists()
    assert run([str(launcher), "--version"], env).stdout.strip() == f"tunedeck {VERSION}"

    run([str(root / "uninstall.sh")], env)
    assert not (root / "env").exists() and not desktop.exists() and not launcher.exists()


# ------------------------------------------------------------------------------------------- engine pieces


def fake_uv(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "uv"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def collect(events: Iterator[SetupEvent]) -> list[SetupEvent]:
    return list(events)


def test_cancel_stops_uv_at_once(tmp_path: Path) -> None:
    uv = fake_uv(tmp_path, "echo 'Resolved 3 packages in 1ms'\nsleep 600")
    cancel = CancelToken()
    started = time.monotonic()
    events = []
    for event in run_uv([str(uv)], clean_env(), tmp_path / "cache", cancel):
        events.append(event)
        cancel.cancel()
    assert isinstance(events[-1], SetupCancelled)
    assert time.monotonic() - started < 300, "uv was left to finish its 600 s on its own"  # however busy the machine


def test_progress_counts_prepared_packages(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    body = (
        'for p in a b c; do echo "DEBUG Identified uncached distribution: $p==1"; done\n'
        f"for p in a b c; do mkdir -p '{cache}/archive-v0/'$p; sleep 0.3; done\necho 'Installed 3 packages'"
    )
    events = collect(run_uv([str(fake_uv(tmp_path, body))], clean_env(), cache))
    progress = [(e.done, e.total) for e in events if isinstance(e, Progress)]
    assert progress[-1] == (3, 3) and len(progress) >= 2


def test_swap_keeps_the_old_environment_until_the_new_one_is_ready(tmp_path: Path) -> None:
    layout = InstallLayout(tmp_path, windows=False)
    (layout.env / "bin").mkdir(parents=True)
    (layout.env / "old").write_text("")
    layout.staging.mkdir()
    assert not swap_in_staging(layout) and (layout.env / "old").exists()  # not marked ready: left alone
    (layout.staging / READY).write_text("")
    assert swap_in_staging(layout)
    assert (layout.env / READY).exists() and not layout.staging.exists() and not (tmp_path / "env.old").exists()


def test_caches_live_in_the_installation(tmp_path: Path) -> None:
    layout = InstallLayout(tmp_path / "Program Files" / "TuneDeck", windows=True)
    uv_env = layout.uv_environment({"VIRTUAL_ENV": "x", "PATH": "p"})
    assert uv_env["UV_CACHE_DIR"].startswith(str(layout.root)) and "VIRTUAL_ENV" not in uv_env
    assert uv_env["UV_PYTHON_INSTALL_DIR"] == str(layout.root / "python")
    app_env = layout.app_environment({"HF_HOME": "/mine"})
    assert app_env["HF_HOME"] == "/mine" and app_env["TORCH_HOME"] == str(layout.root / "cache" / "torch")
    assert layout.python() == layout.root / "env" / "Scripts" / "python.exe"


def test_repacked_wheel_matches_the_installed_files(tmp_path: Path) -> None:
    dist = next(d for d in installed_distributions() if d.key == "iniconfig")
    wheel = repack(dist, tmp_path)
    assert wheel.name == f"iniconfig-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        record = archive.read(f"{dist.name}-{dist.version}.dist-info/RECORD").decode()
    installed = {str(f) for f in dist.dist.files or () if "__pycache__" not in str(f)}
    assert "iniconfig/__init__.py" in names and f"{dist.name}-{dist.version}.dist-info/WHEEL" in names
    assert not any(n.endswith(("INSTALLER", "direct_url.json", ".pyc")) for n in names)
    assert names <= installed | {f"{dist.name}-{dist.version}.dist-info/RECORD"}
    assert all(line.count(",") == 2 for line in record.splitlines()) and "sha256=" in record


# ----------------------------------------------------------------------------------------------- the wheel


def build_script() -> ModuleType:
    """packaging/build as a module (it has no .py suffix: it is run as a program)."""
    loader = importlib.machinery.SourceFileLoader("packaging_build", str(REPO / "packaging" / "build"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("versions", "missing"),
    [
        ({"setuptools": (84, 2, 1)}, []),
        ({"setuptools": (69, 0, 0), "wheel": (0, 38, 4)}, []),
        ({"setuptools": (69, 0, 0)}, ["wheel"]),
        ({"setuptools": (66, 1, 1)}, ["setuptools>=68", "wheel"]),
        ({}, ["setuptools>=68", "wheel"]),
    ],
)
def test_build_names_the_build_tools_this_python_lacks(
    versions: dict[str, tuple[int, ...]], missing: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    build = build_script()
    monkeypatch.setattr(build, "_version", versions.get)
    assert build.missing_build_tools() == missing


BUILD_WHEEL = """
import importlib.machinery, importlib.util, pathlib, sys
loader = importlib.machinery.SourceFileLoader("packaging_build", sys.argv[1])
module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
loader.exec_module(module)
print(module.build_wheel(pathlib.Path(sys.argv[2])))
"""


def build_wheel_with(python: Path, work: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", BUILD_WHEEL, str(REPO / "packaging" / "build"), str(work)],
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip


@pytest.mark.slow
def test_wheel_builds_under_a_plain_system_python_without_wheel(tmp_path: Path) -> None:
    """A fresh venv of this machine's Python: setuptools from ensurepip, older than pyproject asks, no wheel."""
    subprocess.run([base_python(), "-m", "venv", str(tmp_path / "venv")], check=True, timeout=HANG_S)
    python = tmp_path / "venv" / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import wheel"], capture_output=True).returncode != 0
    result = build_wheel_with(python, tmp_path / "work")
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "building the wheel in an isolated environment" in output
    if result.returncode == 0:
        wheel = Path(result.stdout.strip().splitlines()[-1])
        assert wheel.name == f"tunedeck-{VERSION}-py3-none-any.whl" and zipfile.is_zipfile(wheel)
    else:  # no package index reachable: the message says what is missing and the other way to build
        assert "lacks setuptools>=68 and wheel" in output and ".venv/bin/python" in output


def test_a_python_without_pip_is_told_what_to_do(tmp_path: Path) -> None:
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=HANG_S)
    result = build_wheel_with(tmp_path / "venv" / "bin" / "python", tmp_path / "work")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "has no pip" in result.stderr and ".venv/bin/python" in result.stderr
