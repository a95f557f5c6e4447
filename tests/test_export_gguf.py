"""GGUF export: files llama.cpp itself loads, with the logits of the merged model.

Each family gets a run folder whose adapter is a random (non-zero) LoRA over all linear layers, so the merge
changes the model measurably. The exported file is loaded with llama-cpp-python (llama.cpp's own loader and
kernels) and its next-token logits are compared with transformers running the merged float32 model:
f16 within 2% of the largest logit, q8_0 with the same argmax on at least 95% of positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_model, build_tokenizer

from engine.config import RunConfig
from engine.errors import TuneDeckError
from engine.export import GGUF_QUANTS, ExportProgress, export_gguf, merged_model, supported_gguf_family
from engine.models import demo_model_dir

F16_TOLERANCE = 0.02  # of the largest |logit|: f16 weights and llama.cpp's f16 activations
Q8_ARGMAX_AGREEMENT = 0.95
TOKENS = 100

FAMILIES = {  # model_type -> overrides for a tiny model of that family
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "phi3": {"pad_token_id": 0, "bos_token_id": None, "eos_token_id": 2},
    "mistral": {"head_dim": 16},
    "qwen3_moe": {
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "olmoe": {
        "num_key_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": 2,
    },
}


def make_run(model_dir: Path, root: Path) -> Path:
    """A finished-looking run folder: config.json and a random LoRA adapter (with the tokenizer) of ``model_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    run = root / "runs" / "tiny-run"
    (run / "adapter").mkdir(parents=True)
    config = RunConfig.from_dict({"model": {"name": str(model_dir)}, "data": {"path": str(root / "data.jsonl")}})
    config.save(run / "config.json")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    model.save_pretrained(run / "adapter")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(run / "adapter")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 2.5}) + "\n")
    return run


def tiny_family_model(root: Path, model_type: str) -> Path:
    folder = root / model_type
    folder.mkdir()
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(folder, vocab, model_type, **FAMILIES[model_type])
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-runs")
    found = {"demo": make_run(demo_model_dir(), root / "demo")}
    for model_type in FAMILIES:
        found[model_type] = make_run(tiny_family_model(root, model_type), root / f"run-{model_type}")
    return found


def token_ids(vocab_size: int) -> list[int]:
    return [int(i) for i in torch.randint(3, vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(7))]


def transformers_logits(run: Path, ids: list[int]) -> np.ndarray:
    model, _ = merged_model(run, "float32")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def llama_cpp_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=128, logits_all=True, verbose=False, n_threads=2, seed=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def export(run: Path, target: Path, quant: str) -> Path:
    stages: list[ExportProgress] = []
    folder = export_gguf(run, target, quant=quant, on_progress=stages.append)
    assert [s.stage for s in stages][0] == "merging" and stages[-1] == ExportProgress("writing", 1, 1)
    assert any(s.stage == "converting" and s.done == s.total for s in stages)
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["Modelfile", "README.md", "tiny-run.gguf"]
    return folder / "tiny-run.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["demo", *FAMILIES])
def test_llama_cpp_loads_the_export_with_the_merged_logits(runs: dict[str, Path], tmp_path: Path, family: str) -> None:
    pytest.importorskip("llama_cpp")
    run = runs[family]
    base_config = json.loads((Path(RunConfig.load(run / "config.json").model.name) / "config.json").read_text())
    vocab = base_config["vocab_size"]
    ids = token_ids(min(vocab, 280))
    reference = transformers_logits(run, ids)
    f16 = llama_cpp_logits(export(run, tmp_path / "f16", "f16"), ids)
    assert f16.shape == reference.shape
    error = np.abs(f16 - reference).max() / np.abs(reference).max()
    print(f"\n{family}: f16 error {error:.5f}")
    assert error <= F16_TOLERANCE, f"{family}: f16 logits differ by {error:.4f} of the largest logit"
    q8 = llama_cpp_logits(export(run, tmp_path / "q8", "q8_0"), ids)
    agreement = float((q8.argmax(-1) == reference.argmax(-1)).mean())
    print(f"{family}: q8 agreement {agreement:.3f}", np.abs(q8 - reference).max() / np.abs(reference).max())
    assert agreement >= Q8_ARGMAX_AGREEMENT, f"{family}: q8_0 argmax agrees on {agreement:.0%} of positions"
