"""The command line as a user meets it: help, clear errors without tracebacks, and a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hang import HANG_S
from helpers import write_jsonl


def tunedeck(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=HANG_S
    )


def test_help_lists_commands_and_train_flags() -> None:
    top = tunedeck("--help")
    assert top.returncode == 0 and "train" in top.stdout
    train = tunedeck("train", "--help")
    assert train.returncode == 0
    for flag in ("--model", "--data", "--output", "--max-steps", "--config", "--qlora", "--resume", "--demo"):
        assert flag in train.stdout


def test_missing_data_is_a_usage_error() -> None:
    result = tunedeck("train", "--model", "demo")
    assert result.returncode == 2
    assert "no dataset given" in result.stderr and "Traceback" not in result.stderr


def test_bad_flag_value_names_the_setting() -> None:
    result = tunedeck("train", "--data", "x.jsonl", "--lora-rank", "-1")
    assert result.returncode == 2 and "lora.rank" in result.stderr and "Traceback" not in result.stderr


def test_bad_dataset_exits_nonzero_with_one_clear_message(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    result = tunedeck("train", "--model", str(tiny_model_dir), "--data", str(bad), "--output", str(tmp_path))
    assert result.returncode == 1
    assert "line 2 is not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_missing_hub_model_offline_says_so(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = tunedeck("train", "--model", "someone/not-cached-model", "--data", str(data), "--output", str(tmp_path))
    assert result.returncode == 1
    assert "not in the local Hugging Face cache" in result.stderr and "Traceback" not in result.stderr


def test_json_events_and_run_folder(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    result = tunedeck(
        "train", "--model", str(tiny_model_dir), "--data", str(chat_file), "--output", str(tmp_path),
        "--name", "cli-run", "--max-steps", "2", "--data-max-seq-len", "32", "--data-tokens-per-batch", "64", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    kinds = [json.loads(line)["kind"] for line in result.stdout.splitlines()]
    assert kinds[-1] == "RunFinished" and kinds.count("StepMetrics") == 2
    assert (tmp_path / "cli-run" / "adapter" / "adapter_model.safetensors").exists()
