"""The automatic row length and tokens per batch: a GPU keeps its defaults, a CPU follows the model and the data,
and what the user set wins (engine.hardware.row_lengths, engine.run.rows, the profile and the recipes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang import HANG_S

from engine.config import RunConfig
from engine.errors import ConfigError
from engine.hardware import gpus
from engine.hardware.cpu_threads import _busy_seconds, busy_cores, cpu_threads
from engine.hardware.planner import GIB
from engine.hardware.profile import DeviceTarget, build_profile
from engine.hardware.recipes import apply_recipe, estimate_recipe, find_recipe
from engine.hardware.row_lengths import (
    CPU_SHORTEST_ROW,
    CPU_STEP_SECONDS,
    GPU_MAX_SEQ_LEN,
    GPU_TOKENS_PER_BATCH,
    choose_row_lengths,
    cpu_step_seconds,
    cpu_token_budget,
)
from engine.hardware.shapes import ModelShape
from engine.run.rows import resolve_rows

SMOLLM2_135M = ModelShape.from_config_dict(
    {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    "smollm2-135m",
)  # fmt: skip
TINY = ModelShape.from_config_dict(
    {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
        "tie_word_embeddings": True,
    },
    "tiny",
)  # fmt: skip
BUDGET_135M = cpu_token_budget(SMOLLM2_135M, cores=2)

# (case, keyword arguments, expected max_seq_len, expected tokens_per_batch, words in the row-length reason)
CASES = [
    ("gpu defaults, whatever the data", {"on_gpu": True, "longest_document": 37, "shape": SMOLLM2_135M},
     GPU_MAX_SEQ_LEN, GPU_TOKENS_PER_BATCH, "GPU default"),
    ("gpu, long rows set: the batch holds one", {"on_gpu": True, "max_seq_len": 8192}, 8192, 8192, "set by you"),
    ("gpu, short batch set: rows follow it", {"on_gpu": True, "tokens_per_batch": 1024}, 1024, 1024, "lowered"),
    ("gpu, both set", {"on_gpu": True, "max_seq_len": 512, "tokens_per_batch": 768}, 512, 768, "set by you"),
    ("cpu 135M, short documents", {"on_gpu": False, "longest_document": 37, "shape": SMOLLM2_135M, "cpu_cores": 2},
     64, BUDGET_135M, "rounded up"),
    ("cpu 135M, long documents are cut at the budget",
     {"on_gpu": False, "longest_document": 5000, "shape": SMOLLM2_135M, "cpu_cores": 2},
     BUDGET_135M, BUDGET_135M, "cut"),
    ("cpu tiny model: never over the GPU's rows", {"on_gpu": False, "longest_document": 300, "shape": TINY},
     320, GPU_TOKENS_PER_BATCH, "rounded up"),
    ("cpu tiny model, a long document: cut at the GPU's row length",
     {"on_gpu": False, "longest_document": 9000, "shape": TINY}, GPU_MAX_SEQ_LEN, GPU_TOKENS_PER_BATCH, "cut"),
    ("cpu, tokens per batch set: rows at most that",
     {"on_gpu": False, "tokens_per_batch": 256, "longest_document": 1000, "shape": TINY}, 256, 256, "your tokens"),
    ("cpu, row length set: one row holds it",
     {"on_gpu": False, "max_seq_len": 1024, "longest_document": 60, "shape": SMOLLM2_135M, "cpu_cores": 2},
     1024, 1024, "set by you"),
    ("cpu, data not read yet: at most the budget",
     {"on_gpu": False, "shape": SMOLLM2_135M, "cpu_cores": 2}, BUDGET_135M, BUDGET_135M, "at most"),
    ("cpu, no model known: the GPU's rows", {"on_gpu": False, "longest_document": 100}, 128, GPU_TOKENS_PER_BATCH,
     "rounded up"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "given", "row", "tokens", "why"), CASES, ids=[c[0] for c in CASES])
def test_row_lengths_table(case: str, given: dict, row: int, tokens: int, why: str) -> None:
    chosen = choose_row_lengths(**given)
    assert (chosen.max_seq_len, chosen.tokens_per_batch) == (row, tokens)
    assert why in chosen.max_seq_len_reason
    assert chosen.tokens_per_batch >= chosen.max_seq_len
    assert all(line and "\n" not in line for line in chosen.lines())


def test_cpu_budget_trains_a_135m_model_in_seconds_and_grows_with_cores() -> None:
    assert BUDGET_135M % 64 == 0 and CPU_SHORTEST_ROW <= BUDGET_135M < GPU_TOKENS_PER_BATCH
    assert cpu_step_seconds(SMOLLM2_135M, BUDGET_135M, 2) <= CPU_STEP_SECONDS
    assert cpu_step_seconds(SMOLLM2_135M, BUDGET_135M + 64, 2) > CPU_STEP_SECONDS
    assert cpu_token_budget(SMOLLM2_135M, cores=8) > BUDGET_135M
    assert cpu_token_budget(SMOLLM2_135M, cores=2, qlora=True) <= BUDGET_135M
    reason = choose_row_lengths(on_gpu=False, shape=SMOLLM2_135M, cpu_cores=2).tokens_per_batch_reason
    assert "2 CPU threads" in reason and "--grad-accum" in reason


def test_refused_combination_says_which_values_would_work() -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_dict({"data": {"max_seq_len": 2048, "tokens_per_batch": 256}})
    assert "--tokens-per-batch 2048" in str(refused.value) and "--max-seq-len 256" in str(refused.value)
    alone = RunConfig.from_dict({"data": {"tokens_per_batch": 256}}).data
    assert (alone.max_seq_len, alone.tokens_per_batch) == (0, 256)


def test_gpu_profiles_keep_their_rows() -> None:
    """Faked cards: the automatic row length plans exactly as the old default of 2,048 did."""
    shape = ModelShape.from_config_dict(
        {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936},
        "qwen3-0.6b",
    )  # fmt: skip
    for name in ("RTX 4060 laptop", "RTX 4090", "H200"):
        card = DeviceTarget.from_spec(gpus.find_gpu(name))  # type: ignore[arg-type]
        automatic = build_profile(card, shape)
        assert automatic.to_dict() == build_profile(card, shape, min_tokens=GPU_MAX_SEQ_LEN).to_dict()
        assert automatic.max_seq_len is None and "max_seq_len" not in automatic.choices()
        config = apply_recipe(RunConfig(), find_recipe("Balanced"))
        assert estimate_recipe(config, shape, card, 1_000_000).steps == -(-1_000_000 // GPU_TOKENS_PER_BATCH)


def test_cpu_profile_says_what_it_chose_and_why() -> None:
    cpu = DeviceTarget(None, gpus.CPU, None, 24 * GIB, cpu_cores=2)
    profile = build_profile(cpu, SMOLLM2_135M)
    assert profile.max_seq_len is not None and profile.tokens_per_batch is not None
    assert profile.tokens_per_batch.value == BUDGET_135M and "2 CPU threads" in profile.tokens_per_batch.reason
    assert "longest example" in profile.max_seq_len.reason
    assert profile.memory_plan is not None and profile.memory_plan.fits
    mine = build_profile(cpu, SMOLLM2_135M, overrides={"tokens_per_batch": 1024}, min_tokens=512)
    assert mine.tokens_per_batch is not None and mine.tokens_per_batch.value == 1024
    assert mine.max_seq_len is not None and mine.max_seq_len.value == 512
    config = apply_recipe(RunConfig(), find_recipe("Balanced"))
    assert estimate_recipe(config, SMOLLM2_135M, cpu, 10_000).steps == -(-10_000 // BUDGET_135M)


def test_a_gpu_run_resolves_to_the_defaults_without_reading_the_data(tmp_path: Path) -> None:
    config = RunConfig.from_dict({"data": {"path": str(tmp_path / "never-read.jsonl")}})
    steps = resolve_rows(config, None, torch.device("cuda"), tmp_path)
    with pytest.raises(StopIteration) as done:
        next(steps)
    resolved = done.value.value
    assert (resolved.data.max_seq_len, resolved.data.tokens_per_batch) == (GPU_MAX_SEQ_LEN, GPU_TOKENS_PER_BATCH)
    saved = json.loads((tmp_path / "config.json").read_text())["data"]
    assert (saved["max_seq_len"], saved["tokens_per_batch"]) == (GPU_MAX_SEQ_LEN, GPU_TOKENS_PER_BATCH)


# (given threads, cores, cores others keep busy, threads to train with, lowered)
THREAD_CASES = [
    (2, 2, 0.2, 2, False),  # an idle machine
    (2, 2, 1.0, 1, True),  # one core busy elsewhere
    (2, 2, 6.5, 1, True),  # a crowded machine: never fewer than one
    (16, 16, 4.0, 12, True),
    (1, 2, 0.0, 1, False),  # the window's cap (one core kept for it) is never raised
]


@pytest.mark.parametrize(("given", "cores", "load", "threads", "lowered"), THREAD_CASES)
def test_cpu_threads_leave_busy_cores_alone(given: int, cores: int, load: float, threads: int, lowered: bool) -> None:
    chosen, why = cpu_threads(given, cores, load)
    assert chosen == threads and (why is not None) == lowered
    if why is not None:
        assert f"{threads} CPU thread" in why and f"about {load:.1f} of {cores} cores busy" in why


def test_busy_cores_leave_out_this_process_own_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over 2 s the machine was busy for 5 CPU-seconds, 3 of them this process's (an earlier run's threads, say):
    others keep 1 core busy."""
    from engine.hardware import cpu_threads as module

    machine, own, clock = iter([100.0, 105.0]), iter([10.0, 13.0]), iter([50.0, 52.0])
    monkeypatch.setattr(module, "PROC_STAT", Path(__file__))  # exists: the /proc/stat path is taken
    monkeypatch.setattr(module, "_machine_busy", lambda ticks: next(machine))
    monkeypatch.setattr(module.time, "process_time", lambda: next(own))
    monkeypatch.setattr(module.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(module.time, "sleep", lambda seconds: None)
    assert busy_cores() == pytest.approx(1.0)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_busy_cores_count_a_program_that_keeps_a_core_busy() -> None:
    code = (
        "import time\nprint('spinning', flush=True)\n"
        "end = time.monotonic() + 600\n"  # not a hang bound: only stops a spinner that outlives the test
        "while time.monotonic() < end: 0"
    )
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "spinning"
        theirs = busy_cores(sample_s=1.0)
    finally:
        other.kill()
        other.wait()
    assert theirs is not None and theirs >= 0.5, theirs


def test_busy_cores_read_the_proc_stat_busy_fields() -> None:
    line = "cpu  100 20 30 1000 50 5 5 10 7 0"  # guest (7) is inside user
    assert _busy_seconds(line, 100) == pytest.approx((100 + 20 + 30 + 5 + 5 + 10) / 100)


def tunedeck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, env=env, timeout=HANG_S
    )


def test_a_cpu_run_says_what_it_chose_and_prints_only_the_switches_that_apply(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    result = tunedeck(
        "train", "--model", str(tiny_model_dir), "--data", str(chat_file), "--output", str(tmp_path),
        "--name", "rows", "--max-steps", "1", "--device", "cpu", "--eval-fraction", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    row = next(line for line in notes if line.startswith("note: row length 64 tokens: the longest example ("))
    assert "rounded up to a multiple of 64" in row
    tokens = next(line for line in notes if line.startswith("note: tokens per batch 4,096: "))
    assert "a step for" in tokens and "CPU thread" in tokens
    speed = result.stderr[result.stderr.index("speed settings from step 0:") :].splitlines()
    end = next(i for i, line in enumerate(speed) if "more are off: they need an NVIDIA GPU" in line)
    shown = speed[1:end]
    assert any(line.startswith("  fused loss: on") for line in shown) and len(shown) < 6
    assert not any(": off (" in line for line in shown), shown
    saved = json.loads((tmp_path / "rows" / "config.json").read_text())["data"]
    assert (saved["max_seq_len"], saved["tokens_per_batch"]) == (64, 4096)


def test_the_command_line_refuses_a_row_longer_than_its_batch_and_says_what_would_work(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    result = tunedeck("train", "--data", str(data), "--max-seq-len", "2048", "--tokens-per-batch", "256")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "must be at least max_seq_len (2048), got 256" in result.stderr
    assert "--tokens-per-batch 2048" in result.stderr and "--max-seq-len 256" in result.stderr


def test_tunedeck_plan_on_a_cpu_gives_one_line_each_for_row_length_and_tokens_per_batch(tiny_model_dir: Path) -> None:
    plan = subprocess.run(
        [sys.executable, "-c", PLAN_ON_A_CPU, str(tiny_model_dir)], capture_output=True, text=True, timeout=HANG_S
    )
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    row = [line for line in lines if line.strip().startswith("max_seq_len ")]
    tokens = [line for line in lines if line.strip().startswith("tokens_per_batch ")]
    assert len(row) == 1 and "longest example rounded up" in row[0]
    assert len(tokens) == 1 and "CPU thread" in tokens[0]


PLAN_ON_A_CPU = """
import dataclasses, sys
from engine.hardware import cli, detect
real = detect.detect_hardware
def without_gpus():
    return dataclasses.replace(real(), gpus=())
detect.detect_hardware = without_gpus
raise SystemExit(cli.plan_main(["--model", sys.argv[1]]))
"""
"""``tunedeck plan`` as on a machine without a GPU (the GPU machine runs this test too)."""


def test_a_preference_pair_fits_one_row() -> None:
    """DPO packs a pair's two answers into one row: the automatic batch holds two rows' worth."""
    gpu = choose_row_lengths(on_gpu=True, documents_per_item=2)
    assert (gpu.max_seq_len, gpu.tokens_per_batch) == (GPU_MAX_SEQ_LEN, GPU_TOKENS_PER_BATCH)
    long_rows = choose_row_lengths(on_gpu=True, max_seq_len=4096, documents_per_item=2)
    assert long_rows.tokens_per_batch == 8192
    cpu = choose_row_lengths(on_gpu=False, longest_document=5000, shape=SMOLLM2_135M, cpu_cores=2, documents_per_item=2)
    assert cpu.tokens_per_batch >= 2 * cpu.max_seq_len and cpu.tokens_per_batch == BUDGET_135M
    RunConfig.from_dict({"data": {"max_seq_len": cpu.max_seq_len, "tokens_per_batch": cpu.tokens_per_batch}})
