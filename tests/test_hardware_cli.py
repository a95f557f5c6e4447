"""`tunedeck detect` and `tunedeck plan` end to end (on whatever this machine is, and on table GPUs)."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.cli.flags import add_config_flags
from engine.hardware.cli import _common, detect_main, generic_gpu_name, plan_main


def test_detect_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert detect_main(["--json", "--model", "qwen3-0.6b"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["gpu_class"] and out["profile"]["choices"]["dtype"]["reason"]


def test_detect_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert detect_main([]) == 0
    out = capsys.readouterr().out
    assert "Settings:" in out and "dtype" in out


def test_plan_for_a_laptop_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", "qwen3-0.6b", "--gpu", "4060 laptop"]) == 0
    out = capsys.readouterr().out
    assert "RTX 4060 Laptop (8 GiB)" in out and "tokens_per_batch" in out and "tokens/s" in out


def test_plan_json_with_vram_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        plan_main(["--model", "llama-3.1-8b", "--vram", "24", "--qlora", "--checkpointing", "standard", "--json"]) == 0
    )
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["fits"] is True
    assert profile["choices"]["qlora"]["value"] is True and profile["choices"]["checkpointing"]["value"] == "standard"
    assert profile["predicted_peak_gib"] <= profile["usable_gib"]
    assert profile["longest_row_tokens"] > 16384  # offloaded, with the MLPs in chunks


def test_a_card_given_by_its_memory_is_named_so_and_claims_no_fp8(capsys: pytest.CaptureFixture[str]) -> None:
    """--vram plans an RTX 40-class card by its memory; its architecture, and so fp8 tensor cores, is not known."""
    assert plan_main(["--model", "llama-3.1-8b", "--vram", "8", "--qlora"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Llama-3.1-8B on an 8 GiB GPU") and "fp8" not in out
    assert [generic_gpu_name(gib) for gib in (8, 11, 12, 18, 24, 80, 6.5)] == [
        "an 8 GiB GPU", "an 11 GiB GPU", "a 12 GiB GPU", "an 18 GiB GPU", "a 24 GiB GPU", "an 80 GiB GPU",
        "a 6.5 GiB GPU",
    ]  # fmt: skip
    assert plan_main(["--model", "llama-3.1-8b", "--gpu", "RTX 4060", "--qlora"]) == 0
    assert "RTX 4060 has fp8 tensor cores" in capsys.readouterr().out


def test_plan_names_the_longest_row_and_how(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", "llama-3.1-8b", "--vram", "12"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Longest row"))
    assert line.startswith("Longest row that trains: ") and line.endswith(
        "tokens, with QLoRA and offloaded checkpointing, the MLPs in chunks of 1,024 tokens"
    )


def test_plan_names_the_layers_that_skip_the_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    """A 24 GB card planning 4,096-token rows of an 8B model in 4-bit has memory left for resident layers; the line
    says how many, the JSON gives the count, and the speed estimate counts their saved recompute."""
    argv = ["--model", "llama-3.1-8b", "--gpu", "RTX 4090", "--qlora", "--tokens-per-batch", "4096"]
    assert plan_main(argv) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Resident layers"))
    assert "of 32 layers keep their activations in the memory left and skip the recompute (up to ~" in line
    assert plan_main([*argv, "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["resident_layers"] == int(line.split()[2]) > 0
    assert plan_main(["--model", "llama-3.1-8b", "--gpu", "RTX 4090", "--qlora", "--checkpointing", "none"]) == 0
    assert "Resident layers" not in capsys.readouterr().out  # nothing recomputes, nothing to skip


def test_plan_says_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", "qwen3-30b-a3b", "--gpu", "RTX 3060 Laptop"]) == 0
    assert "does not fit" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--model", "x", "--gpu", "Voodoo 3"], ["--model", "no-such-model", "--vram", "8"]])
def test_plan_errors_are_messages(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(argv) == 2
    assert "error:" in capsys.readouterr().err


def test_help_exits_cleanly() -> None:
    for main in (detect_main, plan_main):
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0


def test_plan_takes_the_demo_model_as_train_does(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.config import demo_model_dir

    plans = []
    for model in ("demo", str(demo_model_dir())):
        assert plan_main(["--model", model, "--vram", "8", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0]["model"] == "demo"
    same, folder = plans[0]["profile"], plans[1]["profile"]
    assert same["fits"] is True and same["predicted_peak_gib"] == folder["predicted_peak_gib"]
    assert {k: c["value"] for k, c in same["choices"].items()} == {k: c["value"] for k, c in folder["choices"].items()}
    assert detect_main(["--json", "--model", "demo"]) == 0


def test_plan_batch_flag_has_train_spelling_and_the_old_one(capsys: pytest.CaptureFixture[str]) -> None:
    outputs = []
    for flag in ("--tokens-per-batch", "--tokens"):
        assert plan_main(["--model", "qwen3-0.6b", "--vram", "16", flag, "4096", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["profile"]["choices"]["tokens_per_batch"])
    assert outputs[0] == outputs[1] and outputs[0]["value"] == 4096


def test_plan_declares_train_settings_as_train_does() -> None:
    """--checkpointing, --lora-rank and --max-seq-len take the values and carry the help tunedeck train gives them."""
    train, plan = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_config_flags(train)
    _common(plan)
    for flag in ("--checkpointing", "--lora-rank", "--max-seq-len"):
        ours = next(a for a in plan._actions if flag in a.option_strings)
        theirs = next(a for a in train._actions if flag in a.option_strings)
        assert (ours.choices, ours.help, ours.metavar) == (theirs.choices, theirs.help, theirs.metavar)
    assert plan.parse_args(["--checkpointing", "offloaded"]).checkpointing == "offloaded"
    assert plan.parse_args([]).checkpointing == "auto"
