"""Real CUDA out-of-memory errors: forced by capping the allocator below what a full packed row needs (the run
lowers its tokens per micro-batch, finishes, and trains the same curve as the uncapped run), and a passing one in
step 2 that costs one retry and nothing else; and expandable segments for a run started after CUDA."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import build_model, build_tokenizer, write_jsonl

from engine.bench import app_path
from engine.config import RunConfig
from engine.events import OomRecovered, RunFinished, StepMetrics
from engine.train import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough that the activations of a 16k-token row dominate memory (about 64M parameters)."""
    folder = tmp_path_factory.mktemp("wide")
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(
        folder,
        vocab,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    return folder


def long_texts(path: Path) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "convert", "march", "2021", "hello", "there", "fox"]
    rng = random.Random(0)
    return write_jsonl(path, [{"text": " ".join(rng.choice(words) for _ in range(1500))} for _ in range(64)])


def make_config(model: Path, data: Path, out: Path) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model), "dtype": "float32"},
            "data": {"path": str(data), "max_seq_len": 2048, "tokens_per_batch": 16384, "eval_fraction": 0.0},
            "lora": {"rank": 8, "alpha": 16.0},
            "training": {"max_steps": 4, "warmup_steps": 1, "save_every": 0, "eval_every": 0, "device": "cuda"},
            "speed": {"checkpointing": "none"},
            "output": {"dir": str(out), "name": "run"},
        }
    )


def test_a_real_cuda_oom_is_recovered_under_a_memory_cap(wide_model: Path, tmp_path: Path) -> None:
    data = long_texts(tmp_path / "long.jsonl")
    free = list(run(make_config(wide_model, data, tmp_path / "free")))
    assert isinstance(free[-1], RunFinished), free[-1]
    peak = max(e.memory_bytes for e in free if isinstance(e, StepMetrics))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.6 * peak / total)
    try:
        capped = list(run(make_config(wide_model, data, tmp_path / "capped")))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert isinstance(capped[-1], RunFinished), capped[-1]
    recovered = [e for e in capped if isinstance(e, OomRecovered)]
    assert [e.action for e in recovered[:2]] == ["retry", "tokens_per_batch"]  # the same settings once, then less
    assert recovered[-1].tokens_per_batch < 16384
    capped_steps = [e for e in capped if isinstance(e, StepMetrics)]
    assert max(e.memory_bytes for e in capped_steps) <= 0.6 * peak
    want = [e.loss for e in free if isinstance(e, StepMetrics)]
    assert [e.loss for e in capped_steps] == pytest.approx(want, rel=1e-4)
    print(
        f"\nuncapped peak {peak / 2**30:.2f} GiB, cap {0.6 * peak / 2**30:.2f} GiB, "
        f"recoveries {[(e.step, e.action, e.tokens_per_batch) for e in recovered]}, "
        f"capped peak {max(e.memory_bytes for e in capped_steps) / 2**30:.2f} GiB"
    )


def app_path_rows(tmp_path: Path, paths: str, cap_gib: float) -> dict[str, dict]:
    """Fresh processes of the window's (and the CLI's) run path on a two-layer QLoRA model, by path."""
    out = tmp_path / "rows.json"
    argv = ["--tiny", "--cap", str(cap_gib), "--steps", "8", "--planned-steps", "40", "--rows", "32", "--tokens",
            "1024", "--paths", paths, "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    app_path.main(argv)
    return {row["path"]: row for row in json.loads(out.read_text())}


def test_a_run_started_after_cuda_trains_with_expandable_segments(tmp_path: Path) -> None:
    """CUDA started before the allocator setting (hardware detection first, no variable in the environment): the
    run applies it through torch's settings API and the allocator's own segments say it took."""
    rows = app_path_rows(tmp_path, "app-cuda-first,app", cap_gib=0)
    for row in rows.values():
        assert row["outcome"] == "RunFinished", row
        assert row["expandable_segments"] is True, row
        assert not [n for n in row["notices"] if "fragment" in n], row["notices"]


def test_a_real_cuda_oom_in_step_2_costs_one_retry_and_no_switch(tmp_path: Path) -> None:
    """The window's path with the memory under a 4 GiB cap taken while step 2 runs: a real CUDA out-of-memory error,
    one retry with the same settings, and the run ends with the switches of the run that never ran short."""
    rows = app_path_rows(tmp_path, "app,app-oom", cap_gib=4)
    plain, short = rows["app"], rows["app-oom"]
    assert short["fault"]["real"] and short["fault"]["hog_bytes"] > 0, short["fault"]
    assert short["memory_events"] == ["step 2: OomRecovered retry"], short["memory_events"]
    assert short["outcome"] == plain["outcome"] == "RunFinished"
    assert short["switches_on"] == plain["switches_on"]
