"""Late step readout on a GPU: the update is queued with no host sync, and a run trains the curve of one that
reads every step at once."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from helpers import build_model, build_tokenizer, write_jsonl

from engine.config import RunConfig
from engine.events import EvalMetrics, RunFinished, StepMetrics
from engine.run import readout
from engine.train import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "non-finite"])
def test_a_step_is_clipped_checked_and_updated_without_a_host_sync(bad: bool) -> None:
    params = [torch.nn.Parameter(torch.ones(64, 32, device="cuda")), torch.nn.Parameter(torch.ones(32, device="cuda"))]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    loss = torch.tensor(math.inf if bad else 3.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        values = readout.update_on_device(optimizer, params, loss, 1.0)
        sent = readout.send(values, None, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got_loss, norm, skipped, _ = sent.read()
    assert skipped is bad and norm == pytest.approx(0.5 * math.sqrt(64 * 32 + 32), rel=1e-5)
    assert math.isinf(got_loss) if bad else got_loss == 3.0
    moved = [not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True)]
    assert moved == [not bad, not bad]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("small")
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(folder, vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=1024)  # fmt: skip
    return folder


def config(model: Path, data: Path, out: Path, readout_mode: str) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model), "dtype": "bfloat16"},
            "data": {"path": str(data), "max_seq_len": 256, "tokens_per_batch": 1024, "eval_fraction": 0.1},
            "lora": {"rank": 8, "alpha": 16.0},
            "training": {
                "max_steps": 8,
                "warmup_steps": 1,
                "save_every": 4,
                "eval_every": 3,
                "device": "cuda",
                "step_readout": readout_mode,
            },
            "speed": {"step_graphs": False},  # both runs eager: only the readout differs
            "output": {"dir": str(out), "name": "run"},
        }
    )


def test_a_late_run_on_the_gpu_follows_a_run_read_at_once(small_model: Path, tmp_path: Path) -> None:
    words = ["alpha", "beta", "gamma", "delta", "convert", "march", "2021", "hello", "there", "fox"]
    rng = random.Random(0)
    data = write_jsonl(tmp_path / "texts.jsonl", [{"text": " ".join(rng.choices(words, k=120))} for _ in range(96)])
    events = {mode: list(run(config(small_model, data, tmp_path / mode, mode))) for mode in ("late", "immediate")}
    for mode, got in events.items():
        assert isinstance(got[-1], RunFinished), (mode, got[-1])
    steps = {mode: [e for e in got if isinstance(e, StepMetrics)] for mode, got in events.items()}
    assert [e.step for e in steps["late"]] == list(range(1, 9))
    late, immediate = ([e.loss for e in steps[m]] for m in ("late", "immediate"))
    assert late == pytest.approx(immediate, rel=1e-5)
    evals = {m: [e.loss for e in got if isinstance(e, EvalMetrics)] for m, got in events.items()}
    assert evals["late"] == pytest.approx(evals["immediate"], rel=1e-5)
    assert all(e.step_time_s > 0 and e.memory_bytes > 0 for e in steps["late"])
    print(
        "\nms/step late", [round(e.step_time_s * 1e3, 2) for e in steps["late"]],
        "immediate", [round(e.step_time_s * 1e3, 2) for e in steps["immediate"]],
    )  # fmt: skip
