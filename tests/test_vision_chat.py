"""Asking a picture-and-prompt question of the base and tuned model, scoring held-out image examples, and the
vision part of the memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_vision_train import COLOURS, colour_rows, config
from vision_models import BUILDERS, build_vision_model

from engine.events import RunFinished
from engine.run.vision_report import score
from engine.train import run
from engine.vision.chat import ask_about_image
from engine.vision.data import load_vision_examples
from engine.vision.families import QWEN_VL, family_of
from engine.vision.memory import vision_memory


def test_the_tuned_model_answers_an_image_question_and_scores_above_the_base(tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from engine.config import ModelConfig
    from engine.vision.model import load_processor

    model = build_vision_model(tmp_path / "model", "idefics3")
    data = colour_rows(tmp_path)
    events = list(run(config(model, data, tmp_path / "runs", max_steps=40, learning_rate=1e-2)))
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    torch.manual_seed(0)
    tuned = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model), finished.adapter_dir)
    processor = load_processor(ModelConfig(name=str(model)))
    reply = ask_about_image(tuned, processor, tmp_path / "red.png", "colour?", 64 * 64)
    assert isinstance(reply, str)
    examples = load_vision_examples(data)
    before = score(tuned, processor, examples, 64 * 64, tuned=False)
    after = score(tuned, processor, examples, 64 * 64, tuned=True)
    assert before.examples == after.examples == len(COLOURS)
    assert after.token_f1 > before.token_f1, (before.answers, after.answers)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_memory_plan_counts_the_vision_tower_and_image_tokens(family: str, tmp_path: Path) -> None:
    model, _, _ = BUILDERS[family]()
    raw = model.config.to_dict()
    known = family_of({"model_type": family})
    small = vision_memory(raw, known, 64 * 64, 2)
    large = vision_memory(raw, known, 512 * 512, 2)
    assert small.tower_params > 0 and small.tower_bytes == 2 * small.tower_params
    assert 0 < small.image_tokens <= large.image_tokens
    tower = sum(p.numel() for n, p in model.named_parameters() if known.part_of(n) == "vision" and p.dim() == 2)
    assert 0.4 * tower <= small.tower_params <= 2.5 * tower  # an estimate from the config, against the real matrices
    if family == "qwen2_5_vl":  # dynamic resolution: more pixels, more tokens (one per 28x28)
        assert large.image_tokens == 512 * 512 // (28 * 28)
    json.dumps(small.__dict__)


def test_the_step_estimate_adds_the_tower_and_the_image_tokens() -> None:
    from engine.hardware.planner import TrainSetup
    from engine.vision.memory import vision_step_estimate

    config = {  # a Qwen2.5-VL-3B-class shape
        "model_type": "qwen2_5_vl",
        "text_config": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936},
        "vision_config": {"hidden_size": 1280, "intermediate_size": 3420, "depth": 32, "patch_size": 14,
                          "spatial_merge_size": 2},
    }  # fmt: skip
    setup = TrainSetup(tokens=512, checkpointing="standard")
    none = vision_step_estimate(config, QWEN_VL, setup, images_per_row=0, max_pixels=1024 * 28 * 28)
    one = vision_step_estimate(config, QWEN_VL, setup, images_per_row=1, max_pixels=1024 * 28 * 28)
    four = vision_step_estimate(config, QWEN_VL, setup, images_per_row=4, max_pixels=1024 * 28 * 28)
    adapted = vision_step_estimate(
        config, QWEN_VL, setup, images_per_row=1, max_pixels=1024 * 28 * 28, adapt_vision=True
    )
    assert one.parts["image_tokens"] == 1024 and four.parts["image_tokens"] == 4096
    assert 0.4e9 < one.parts["vision_tower"] < 1.6e9  # a ~0.6B-parameter tower in 16 bits
    assert none.peak < one.peak < four.peak
    assert adapted.peak > one.peak  # an adapted tower keeps its activations for backward
