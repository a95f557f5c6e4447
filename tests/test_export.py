"""Exports: the adapter loads with plain peft, the merged model with plain transformers, and both agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_chat import train_tiny_run

from engine.errors import TuneDeckError
from engine.export import export_adapter, export_merged

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 64, 128, 7]])


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="module")
def reference_logits(run_folder: Path, tiny_model_dir: Path) -> torch.Tensor:
    """Base + adapter in float32, loaded the way a user would load them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(TOKENS).logits
    model = PeftModel.from_pretrained(base, str(run_folder / "adapter")).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    assert (logits - base_logits).abs().max() > 1e-3  # the adapter changes the model: the comparisons mean something
    return logits


def test_adapter_export_loads_with_plain_peft(
    run_folder: Path, tiny_model_dir: Path, tmp_path: Path, reference_logits: torch.Tensor
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = export_adapter(run_folder, tmp_path / "adapter-export")
    assert (target / "adapter_model.safetensors").exists()
    assert "PeftModel.from_pretrained" in (target / "README.md").read_text()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(target)).eval()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, reference_logits)
    assert AutoTokenizer.from_pretrained(target).chat_template


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 0.03), ("float16", 0.005)])
def test_merged_model_matches_base_plus_adapter(
    run_folder: Path, tmp_path: Path, reference_logits: torch.Tensor, dtype: str, tolerance: float
) -> None:
    from transformers import AutoModelForCausalLM

    target = export_merged(run_folder, tmp_path / f"merged-{dtype}", dtype=dtype)
    assert list(target.glob("*.safetensors")) and not list(target.glob("adapter_*"))
    assert json.loads((target / "config.json").read_text())["dtype"] == dtype
    model = AutoModelForCausalLM.from_pretrained(target, dtype="auto").eval()
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    with torch.no_grad():
        logits = model(TOKENS).logits.float()
    scale = reference_logits.abs().max()
    assert (logits - reference_logits).abs().max() <= tolerance * scale
    assert "AutoModelForCausalLM.from_pretrained" in (target / "README.md").read_text()


def test_export_refuses_to_overwrite_and_unknown_dtypes(run_folder: Path, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(TuneDeckError, match="not empty"):
        export_adapter(run_folder, target)
    assert (target / "keep.txt").read_text() == "mine"
    with pytest.raises(TuneDeckError, match="unknown export dtype"):
        export_merged(run_folder, tmp_path / "x", dtype="int3")
    export_adapter(run_folder, target, overwrite=True)
    assert not (target / "keep.txt").exists()


def test_export_command_writes_adapter_and_merged(run_folder: Path, tmp_path: Path, monkeypatch) -> None:
    from engine.cli.runs import export_main

    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    assert export_main([str(run_folder), "--to", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "adapter_config.json").exists()
    assert export_main([str(run_folder), "--to", str(tmp_path / "m"), "--merged", "--dtype", "fp16"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float16"
    assert export_main([str(run_folder), "--to", str(tmp_path / "m"), "--merged"]) == 1
    assert export_main(["no-such-run", "--to", str(tmp_path / "x")]) == 1


def test_merged_export_keeps_the_runs_dtype_unless_asked(run_folder: Path, tmp_path: Path) -> None:
    """The tiny run computed in float32 on the CPU (recorded in compute.json): its merge stays float32."""
    from engine.export import run_dtype

    assert json.loads((run_folder / "compute.json").read_text()) == {"dtype": "float32", "device": "cpu"}
    assert run_dtype(run_folder) == "float32"
    target = export_merged(run_folder, tmp_path / "merged")
    assert json.loads((target / "config.json").read_text())["dtype"] == "float32"
    assert "(float32, safetensors)" in (target / "README.md").read_text()
    asked = export_merged(run_folder, tmp_path / "merged-bf16", dtype="bf16")
    assert json.loads((asked / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("recorded", "model_dtype", "device", "expected"),
    [
        ({"dtype": "bfloat16", "device": "cuda"}, "auto", "auto", "bfloat16"),
        ({"dtype": "float16", "device": "cuda"}, "auto", "auto", "float16"),
        (None, "float32", "auto", "float32"),  # a run from before the record: its config says
        (None, "auto", "cpu", "float32"),
        (None, "auto", "auto", "bfloat16"),  # auto on a GPU, unrecorded: the GPU default
        ("not json", "float16", "auto", "float16"),
    ],
)
def test_the_runs_dtype_comes_from_its_record_then_its_config(
    tmp_path: Path, recorded: object, model_dtype: str, device: str, expected: str
) -> None:
    from engine.config import RunConfig
    from engine.export import run_dtype

    config = {"model": {"name": "demo", "dtype": model_dtype}, "data": {"path": "x.jsonl"}}
    RunConfig.from_dict({**config, "training": {"device": device}}).save(tmp_path / "config.json")
    if recorded is not None:
        text = recorded if isinstance(recorded, str) else json.dumps(recorded)
        (tmp_path / "compute.json").write_text(text)
    assert run_dtype(tmp_path) == expected
