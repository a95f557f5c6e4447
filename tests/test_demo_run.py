"""The README's main command, shortened: `tunedeck train --demo` teaches the built-in model its task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hang import HANG_S

from engine.cli.demo import demo_config
from engine.cli.flags import config_from_args
from engine.cli.train import train_parser
from engine.config import RunConfig


def test_demo_flags_override_the_recipe() -> None:
    args = train_parser().parse_args(["--demo", "--max-steps", "7"])
    config = config_from_args(args, demo_config(RunConfig()))
    assert config.model.name == "demo" and config.data.path.endswith("train.jsonl")
    assert config.training.max_steps == 7 and config.training.learning_rate == pytest.approx(3e-3)


@pytest.mark.slow
def test_demo_fine_tune_improves_accuracy(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "train", "--demo", "--max-steps", "80", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "demo accuracy: before" in result.stdout
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    figures = json.loads((run_dir / "demo_result.json").read_text())
    assert figures["accuracy_before"] <= 0.05
    assert figures["accuracy_after"] >= figures["accuracy_before"] + 0.25, figures
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
