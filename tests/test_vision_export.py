"""Exporting a vision-language fine-tune: the adapter and the merged model for every family; GGUF says why not
where llama.cpp could not load the family (tests/test_vision_gguf.py: where it can)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_vision_train import colour_rows, config
from vision_models import BUILDERS, build_vision_model

from engine.config import ModelConfig
from engine.errors import TuneDeckError
from engine.events import RunFinished
from engine.export.merged import export_adapter, export_merged
from engine.export.to_gguf import export_gguf
from engine.train import run
from engine.vision.encode import render
from engine.vision.model import load_processor


def trained(tmp_path: Path, family: str) -> tuple[Path, RunFinished]:
    model = build_vision_model(tmp_path / "model", family)
    events = list(run(config(model, colour_rows(tmp_path), tmp_path / "runs", max_steps=2, learning_rate=5e-2)))
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    return model, finished


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_merged_model_answers_as_base_plus_adapter(family: str, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model, finished = trained(tmp_path, family)
    merged_folder = export_merged(finished.run_dir, tmp_path / "merged", dtype="float32")
    adapter_folder = export_adapter(finished.run_dir, tmp_path / "adapter")
    assert (adapter_folder / "adapter_model.safetensors").exists() and (adapter_folder / "README.md").exists()
    merged = AutoModelForImageTextToText.from_pretrained(merged_folder).eval()
    tuned = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model), str(adapter_folder)).eval()
    processor = load_processor(ModelConfig(name=str(merged_folder)))  # saved beside the merged weights
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = render(processor, messages, prompt=True)
    inputs = processor(text=[text], images=[[Image.open(tmp_path / "red.png").convert("RGB")]], return_tensors="pt")
    with torch.no_grad():
        expected, got = tuned(**inputs).logits, merged(**inputs).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "why"), [("mllama", "no mllama projector"), ("idefics3", "scale_factor) of 2 or more")]
)
def test_gguf_export_of_a_vision_model_llama_cpp_cannot_load_says_why_not(
    family: str, why: str, tmp_path: Path
) -> None:
    _, finished = trained(tmp_path, family)  # the tiny Idefics3 has no pixel shuffle (scale_factor 1)
    with pytest.raises(TuneDeckError, match="not exported to GGUF") as caught:
        export_gguf(finished.run_dir, tmp_path / "gguf")
    assert why in str(caught.value) and "--merged" in (caught.value.hint or "")
    assert not (tmp_path / "gguf").exists()
