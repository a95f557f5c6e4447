"""TuneDeck's private environment: creating it, adding the right torch, checking and repairing it.

An installation is one folder (``%LOCALAPPDATA%\\TuneDeck`` on Windows, ``~/.local/share/tunedeck`` on Linux):

    uv(.exe)               the uv binary the installer brought
    wheels/                TuneDeck's own wheel
    env/                   the Python environment the app runs from
    python/                the Python build uv installed for it
    cache/uv, cache/huggingface, ...
    tunedeck-install.json  what the installer set up (version, Python), so repair can redo it

Caches live inside that folder, on the same drive as the environment: uv can hard-link from its cache instead of
copying, and nothing lands on a nearly full system drive. The installers create the environment without torch;
the app (which does not import torch at start) then installs the torch build that fits the GPU
(engine.setup.torch_build). A repair builds a complete new environment beside the old one and swaps it in only
when it works, so a failed or cancelled repair never leaves things worse than before. On Windows the running app
keeps its own environment locked: the new one is then swapped in by ``finish_pending_repair`` at the next start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from engine.setup.cancel import CancelToken
from engine.setup.events import SetupEvent, SetupFailed, SetupFinished, SetupWarning, StepStarted
from engine.setup.torch_build import TORCH_REQUIREMENT, TorchChoice
from engine.setup.uv_process import run_uv

MARKER = "tunedeck-install.json"
READY = ".tunedeck-ready"
DEFAULT_PYTHON = "3.12"
BASE_INSTALL_BYTES = 1_500_000_000
"""About how much the environment takes without torch (PySide6, transformers, pyarrow, Python itself)."""


@dataclass(frozen=True)
class InstallLayout:
    """Where everything of one installation lives."""

    root: Path
    windows: bool = field(default=sys.platform == "win32")

    @property
    def env(self) -> Path:
        return self.root / "env"

    @property
    def staging(self) -> Path:
        return self.root / "env.new"

    @property
    def uv(self) -> Path:
        return self.root / ("uv.exe" if self.windows else "uv")

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def python(self, env: Path | None = None) -> Path:
        env = env or self.env
        return env / "Scripts" / "python.exe" if self.windows else env / "bin" / "python"

    def uv_environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The process environment for uv: caches and Python builds inside the installation."""
        env = dict(os.environ if base is None else base)
        env.update(
            UV_CACHE_DIR=str(self.cache / "uv"),
            UV_PYTHON_INSTALL_DIR=str(self.root / "python"),
            UV_NO_CONFIG="1",  # a user's uv.toml must not redirect TuneDeck's environment
            UV_NO_PROGRESS="1",
        )
        env.pop("VIRTUAL_ENV", None)
        return env

    def app_environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Variables for the app's process: model and kernel caches beside the installation unless the user set them."""
        env = dict(os.environ if base is None else base)
        defaults = {"HF_HOME": "huggingface", "TORCH_HOME": "torch", "TRITON_CACHE_DIR": "triton",
                    "PIP_CACHE_DIR": "pip", "UV_CACHE_DIR": "uv"}  # fmt: skip
        for name, folder in defaults.items():
            env.setdefault(name, str(self.cache / folder))
        return env

    def read_marker(self) -> dict[str, Any]:
        path = self.root / MARKER
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def write_marker(self, **values: Any) -> None:
        data = {**self.read_marker(), **values}
        (self.root / MARKER).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def current_layout() -> InstallLayout | None:
    """The installation this interpreter runs from, or None for a developer checkout."""
    root = Path(sys.prefix).resolve().parent
    return InstallLayout(root) if (root / MARKER).is_file() else None


def find_uv(layout: InstallLayout) -> Path:
    """The installation's uv, else one on PATH or beside this interpreter (developer machines)."""
    candidates = [layout.uv, shutil.which("uv"), Path(sys.executable).parent / ("uv.exe" if layout.windows else "uv")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError("uv was not found: reinstall TuneDeck, or install uv")


def free_bytes(path: Path) -> int:
    """Free space on the drive that holds ``path`` (or would, once created)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def space_problem(layout: InstallLayout, needed: int) -> str | None:
    free = free_bytes(layout.root)
    if free >= needed:
        return None
    return (
        f"Not enough disk space on the drive of {layout.root}: "
        f"about {needed / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free."
    )


# ---------------------------------------------------------------------------------------------------- jobs


def _offline_args(wheelhouse: Path | None) -> list[str]:
    return [] if wheelhouse is None else ["--offline", "--no-index", "--find-links", str(wheelhouse)]


def _tunedeck_requirement(layout: InstallLayout, wheelhouse: Path | None) -> str:
    wheels = sorted(layout.wheels.glob("tunedeck-*.whl")) if layout.wheels.is_dir() else []
    if wheels:
        return str(wheels[-1])
    version = layout.read_marker().get("version")
    return f"tunedeck=={version}" if version else "tunedeck"


def _log_file(layout: InstallLayout) -> IO[str]:
    layout.logs.mkdir(parents=True, exist_ok=True)
    return open(layout.logs / f"setup-{time.strftime('%Y%m%d-%H%M%S')}.log", "a", encoding="utf-8")


def create_environment(
    layout: InstallLayout,
    target: Path,
    python: str | None = None,
    wheelhouse: Path | None = None,
    cancel: CancelToken | None = None,
    log: IO[str] | None = None,
    steps: tuple[int, int] = (1, 2),
) -> Generator[SetupEvent, None, bool]:
    """A fresh environment at ``target`` with TuneDeck and everything it needs except torch."""
    uv = str(find_uv(layout))
    env = layout.uv_environment()
    python = python or layout.read_marker().get("python") or DEFAULT_PYTHON
    if target.exists():
        shutil.rmtree(target)
    yield StepStarted(steps[0], steps[1], f"Creating the Python {python} environment")
    managed = [] if os.sep in python or "/" in python else ["--managed-python"]
    # Relocatable: entry-point scripts find their Python relative to themselves, so the environment still works
    # after it was built as env.new and renamed to env.
    argv = [uv, "venv", "--relocatable", *managed, "--python", python, *_offline_args(wheelhouse)[:1], str(target)]
    if not (yield from run_uv(argv, env, layout.cache / "uv", cancel, log)):
        return False
    yield StepStarted(steps[0] + 1, steps[1], "Installing TuneDeck (everything except torch)")
    excludes = layout.cache / "excludes.txt"
    excludes.parent.mkdir(parents=True, exist_ok=True)
    excludes.write_text("torch\n")
    argv = [uv, "pip", "install", "--python", str(layout.python(target)), "--excludes", str(excludes),
            *_offline_args(wheelhouse), _tunedeck_requirement(layout, wheelhouse)]  # fmt: skip
    return (yield from run_uv(argv, env, layout.cache / "uv", cancel, log))


def install_torch_into(
    layout: InstallLayout,
    choice: TorchChoice,
    target: Path | None = None,
    wheelhouse: Path | None = None,
    cancel: CancelToken | None = None,
    log: IO[str] | None = None,
    steps: tuple[int, int] = (1, 1),
) -> Generator[SetupEvent, None, bool]:
    """Add torch (the chosen build, or the one in ``wheelhouse``) to an environment."""
    target = target or layout.env
    source = f"from {wheelhouse}" if wheelhouse else f"from {choice.index_url}"
    yield StepStarted(steps[0], steps[1], f"Installing torch ({choice.build}) {source}")
    index = [] if wheelhouse else ["--index", choice.index_url]
    argv = [str(find_uv(layout)), "pip", "install", "--python", str(layout.python(target)), *index,
            *_offline_args(wheelhouse), TORCH_REQUIREMENT]  # fmt: skip
    return (yield from run_uv(argv, layout.uv_environment(), layout.cache / "uv", cancel, log))


def install_torch(
    layout: InstallLayout, choice: TorchChoice, wheelhouse: Path | None = None, cancel: CancelToken | None = None
) -> Iterator[SetupEvent]:
    """First-run setup: put the chosen torch build into the installation's environment."""
    if choice.blocked and not choice.overridden:
        yield SetupFailed(choice.blocked, "or choose the CPU build to continue without the GPU")
        return
    if wheelhouse is None and (problem := space_problem(layout, choice.installed_bytes)):
        yield SetupFailed(problem, "free some space or reinstall TuneDeck on another drive")
        return
    with _log_file(layout) as log:
        if (yield from install_torch_into(layout, choice, wheelhouse=wheelhouse, cancel=cancel, log=log)):
            layout.write_marker(torch_build=_build_label(choice, wheelhouse))
            yield SetupFinished(f"torch {choice.build} installed in {layout.env}")


def _build_label(choice: TorchChoice, wheelhouse: Path | None) -> str:
    return "wheelhouse" if wheelhouse else choice.build


def repair(
    layout: InstallLayout,
    choice: TorchChoice,
    wheelhouse: Path | None = None,
    python: str | None = None,
    cancel: CancelToken | None = None,
) -> Iterator[SetupEvent]:
    """Rebuild the environment from scratch beside the old one, then swap it in."""
    if wheelhouse is None and (problem := space_problem(layout, choice.installed_bytes + BASE_INSTALL_BYTES)):
        yield SetupFailed(problem, "free some space, or repair from an exported wheelhouse")
        return
    (layout.staging / READY).unlink(missing_ok=True)
    with _log_file(layout) as log:
        if not (yield from create_environment(layout, layout.staging, python, wheelhouse, cancel, log, (1, 4))):
            return
        if not (yield from install_torch_into(layout, choice, layout.staging, wheelhouse, cancel, log, (3, 4))):
            return
    yield StepStarted(4, 4, "Checking the new environment")
    health = check_environment(layout, layout.staging)
    if not health.ok:
        yield SetupFailed("the rebuilt environment does not work", "\n".join(health.problems))
        return
    (layout.staging / READY).write_text("")
    layout.write_marker(torch_build=_build_label(choice, wheelhouse))
    if swap_in_staging(layout):
        yield SetupFinished(f"environment rebuilt: {health.summary}")
    else:
        yield SetupWarning("the environment is in use; the repaired one takes over when TuneDeck starts again")
        yield SetupFinished(f"environment rebuilt: {health.summary}", restart_needed=True)


def swap_in_staging(layout: InstallLayout) -> bool:
    """Replace ``env`` with a finished ``env.new``; False when the old one is in use (Windows)."""
    if not (layout.staging / READY).is_file():
        return False
    old = layout.root / "env.old"
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    try:
        if layout.env.exists():
            layout.env.rename(old)
        layout.staging.rename(layout.env)
    except OSError:
        if not layout.env.exists() and old.exists():
            old.rename(layout.env)
        return False
    shutil.rmtree(old, ignore_errors=True)
    return True


def finish_pending_repair(layout: InstallLayout) -> bool:
    """At start, before anything is loaded from ``env``: swap in a repaired environment that is waiting."""
    return (layout.staging / READY).is_file() and swap_in_staging(layout)


# -------------------------------------------------------------------------------------------------- health

_HEALTH_SCRIPT = """
import importlib.metadata as m, json, sys
out = {"python": sys.version.split()[0], "problems": []}
try:
    import engine.cli
    out["tunedeck"] = m.version("tunedeck")
except Exception as err:
    out["problems"].append(f"TuneDeck does not load: {type(err).__name__}: {err}")
try:
    out["torch"] = m.version("torch")
except m.PackageNotFoundError:
    out["torch"] = None
if out["torch"] and "--import-torch" in sys.argv:
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
    except Exception as err:
        out["problems"].append(f"torch does not load: {type(err).__name__}: {err}")
print(json.dumps(out))
"""


@dataclass(frozen=True)
class EnvironmentHealth:
    """What a check of an environment found; ``torch`` is the installed torch version, None if missing."""

    ok: bool
    torch: str | None
    problems: tuple[str, ...]
    python: str | None = None
    torch_cuda: str | None = None

    @property
    def needs_torch(self) -> bool:
        return self.ok and self.torch is None

    @property
    def summary(self) -> str:
        torch = f"torch {self.torch}" if self.torch else "no torch yet"
        return f"Python {self.python}, {torch}" + (f" (CUDA {self.torch_cuda})" if self.torch_cuda else "")


def check_environment(layout: InstallLayout, env: Path | None = None, import_torch: bool = True) -> EnvironmentHealth:
    """Start the environment's Python and check that TuneDeck (and torch, if installed) load and agree."""
    python = layout.python(env or layout.env)
    if not python.is_file():
        return EnvironmentHealth(False, None, (f"no Python at {python}",))
    argv = [str(python), "-c", _HEALTH_SCRIPT, *(["--import-torch"] if import_torch else [])]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=layout.app_environment())
        found = json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        return EnvironmentHealth(False, None, (f"the environment's Python does not start: {err}",))
    problems = list(found["problems"])
    try:
        uv = str(find_uv(layout))
        check = subprocess.run([uv, "pip", "check", "--python", str(python)], capture_output=True, text=True,
                               timeout=120, env=layout.uv_environment())  # fmt: skip
        if check.returncode != 0:
            problems += [line for line in check.stdout.splitlines() if line.strip()][:10]
    except (OSError, subprocess.SubprocessError) as err:
        problems.append(f"could not check dependencies: {err}")
    return EnvironmentHealth(
        not problems, found.get("torch"), tuple(problems), found.get("python"), found.get("torch_cuda")
    )
