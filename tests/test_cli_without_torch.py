"""After the Linux installer torch arrives at the first start: until then, commands that need it say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hang import HANG_S

from engine.cli.commands import TORCH_MISSING_EXIT
from engine.config import RunConfig

WITHOUT_TORCH = """
import importlib.machinery, sys

class NoTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None  # as if torch were not installed: `import torch` raises ModuleNotFoundError
        return super().find_spec(name, path, target)

sys.meta_path[:] = [NoTorch if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


def tunedeck_without_torch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=HANG_S
    )


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    """A finished run's folder, as far as the commands look before loading a model."""
    folder = tmp_path / "runs" / "finished"
    (folder / "adapter").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(RunConfig().to_dict()))
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "demo"}))
    return folder


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--demo"],
        ["train", "--data", "chats.jsonl"],
        ["bench"],
        ["chat", "RUN", "--prompt", "hi"],
        ["export", "RUN", "--to", "merged", "--merged"],
    ],
    ids=lambda args: " ".join(args[:2]),
)
def test_a_command_that_needs_torch_says_how_to_get_it(args: list[str], run_folder: Path, tmp_path: Path) -> None:
    args = [str(run_folder) if word == "RUN" else word for word in args]
    result = tunedeck_without_torch(*args, cwd=tmp_path)
    assert result.returncode == TORCH_MISSING_EXIT, result.stderr
    assert "torch is not installed" in result.stderr
    assert "tunedeck setup install-torch" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "runs" / "finished" / "checkpoints").exists()
    assert not (tmp_path / "merged").exists()


def test_commands_that_do_not_need_torch_still_work(run_folder: Path, tmp_path: Path) -> None:
    assert tunedeck_without_torch("--help", cwd=tmp_path).returncode == 0
    assert tunedeck_without_torch("train", "--help", cwd=tmp_path).returncode == 0
    plan = tunedeck_without_torch("plan", "--model", "llama-3.1-8b", "--vram", "24", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    exported = tunedeck_without_torch("export", str(run_folder), "--to", "adapter", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


def test_the_blocker_really_hides_torch(tmp_path: Path) -> None:
    code = WITHOUT_TORCH.replace("from engine.cli import main\nsys.exit(main(sys.argv[1:]))", "import torch")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr
