"""Training a vision-language model: LoRA on the language model, the vision tower frozen, the loss falls, the
adapter loads in plain peft, checkpoints resume, an unknown vision family is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import write_jsonl
from vision_models import BUILDERS, build_vision_model, draw

from engine.config import RunConfig
from engine.events import Notice, RunFailed, RunFinished, RunStarted, StepMetrics
from engine.train import run
from engine.vision.families import FAMILIES, family_of, lora_targets

COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20), "yellow": (230, 220, 20)}


def colour_rows(folder: Path) -> Path:
    rows = []
    for name, rgb in COLOURS.items():
        draw(folder / f"{name}.png", rgb)
        user = [{"type": "image", "image": f"{name}.png"}, {"type": "text", "text": "colour?"}]
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": name}]})
    return write_jsonl(folder / "colours.jsonl", rows)


def config(model: Path, data: Path, out: Path, **training: Any) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model)},
            "data": {"path": str(data), "eval_fraction": 0, "tokens_per_batch": 4096, "max_seq_len": 2048},
            "lora": {"rank": 8, "alpha": 16},
            "training": {"learning_rate": 5e-3, "device": "cpu", "save_every": 0, "warmup_steps": 0, **training},
            "output": {"dir": str(out), "name": "vision"},
        }
    )


@pytest.fixture(scope="module")
def idefics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("idefics3"), "idefics3")


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_lora_adapts_the_language_model_and_leaves_the_vision_tower_frozen(family: str, tmp_path: Path) -> None:
    model = build_vision_model(tmp_path / "model", family)
    events = list(run(config(model, colour_rows(tmp_path), tmp_path / "runs", max_steps=2)))
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert finished, [e for e in events if isinstance(e, RunFailed)]
    notices = " ".join(e.message for e in events if isinstance(e, Notice))
    assert "padded, not packed" in notices and "images checked" in notices
    assert "memory plan: about" in notices and "the vision tower's" in notices
    started = next(e for e in events if isinstance(e, RunStarted))
    assert started.estimated_s is not None and started.estimated_s > 0  # on the CPU, from the planner
    adapter = json.loads((Path(finished[0].adapter_dir) / "adapter_config.json").read_text())
    known = family_of(json.loads((model / "config.json").read_text()))
    targets = adapter["target_modules"]
    assert targets and all(known.part_of(name) == "language" for name in targets)


def test_the_loss_falls_and_the_adapter_loads_in_plain_peft(idefics: Path, tmp_path: Path) -> None:
    events = list(run(config(idefics, colour_rows(tmp_path), tmp_path / "runs", max_steps=24, learning_rate=1e-2)))
    losses = [e.loss for e in events if isinstance(e, StepMetrics)]
    assert len(losses) == 24, [e for e in events if isinstance(e, RunFailed)]
    assert sum(losses[-4:]) < 0.92 * sum(losses[:4])  # a tiny random model: from about 5.4 to under 5
    started = next(e for e in events if isinstance(e, RunStarted))
    assert 0 < started.trainable_params < started.total_params
    (finished,) = [e for e in events if isinstance(e, RunFinished)]

    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = AutoModelForImageTextToText.from_pretrained(idefics)
    tuned = PeftModel.from_pretrained(base, finished.adapter_dir)
    processor = AutoProcessor.from_pretrained(finished.adapter_dir)  # saved beside the adapter
    weights = dict(tuned.named_parameters())
    assert any("lora_B" in name and bool(p.abs().sum() > 0) for name, p in weights.items())
    assert torch.equal(
        tuned.base_model.model.model.vision_model.embeddings.patch_embedding.weight,
        base.model.vision_model.embeddings.patch_embedding.weight,
    )
    assert processor.image_token == "<image>"


def test_a_run_resumes_from_its_checkpoint_and_keeps_the_best_adapter(idefics: Path, tmp_path: Path) -> None:
    data = colour_rows(tmp_path)
    first = config(idefics, data, tmp_path / "runs", max_steps=4, save_every=2, eval_every=2)
    first.data.eval_fraction = 0.25
    events = list(run(first, resume=None))
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    assert finished.best_adapter_dir and (Path(finished.best_adapter_dir) / "adapter_model.safetensors").exists()
    run_dir = Path(finished.run_dir)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints, "a checkpoint is kept"
    longer = config(idefics, data, tmp_path / "runs", max_steps=6, save_every=2, eval_every=2)
    saved = json.loads((run_dir / "config.json").read_text())
    saved["training"]["max_steps"] = 6
    (run_dir / "config.json").write_text(json.dumps(saved))
    resumed = list(run(longer, resume=run_dir))
    steps = [e.step for e in resumed if isinstance(e, StepMetrics)]
    assert steps == [5, 6], [e for e in resumed if isinstance(e, (RunFailed, Notice))]


def test_an_unknown_vision_family_is_refused_naming_the_known_ones(idefics: Path, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "llava"
    shutil.copytree(idefics, model)
    raw = json.loads((model / "config.json").read_text())
    raw["model_type"] = "llava"
    (model / "config.json").write_text(json.dumps(raw))
    events = list(run(config(model, colour_rows(tmp_path), tmp_path / "runs", max_steps=1)))
    (failed,) = [e for e in events if isinstance(e, RunFailed)]
    assert "llava" in failed.message
    assert all(family.label in (failed.hint or "") for family in FAMILIES)


def test_adapting_the_vision_tower_too_targets_its_linear_layers() -> None:
    (qwen,) = [family for family in FAMILIES if "qwen2_5_vl" in family.model_types]
    modules = [
        ("model.language_model.layers.0.self_attn.q_proj", "Linear"),
        ("model.visual.blocks.0.attn.qkv", "Linear"),
        ("model.visual.merger.mlp.0", "Linear"),
        ("model.visual.blocks.0.norm1", "RMSNorm"),
        ("lm_head", "Linear"),
    ]
    assert lora_targets(qwen, modules, adapt_vision=False) == ["model.language_model.layers.0.self_attn.q_proj"]
    assert lora_targets(qwen, modules, adapt_vision=True) == [name for name, kind in modules[:3]]


def test_qlora_quantizes_the_language_model_only_and_trains(idefics: Path, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    import torch

    from engine.config import ModelConfig
    from engine.vision.families import IDEFICS3
    from engine.vision.model import load_vision_model

    model = load_vision_model(ModelConfig(name=str(idefics), qlora=True), IDEFICS3, torch.device("cpu"), torch.float32)
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    language = [kind for name, kind in kinds.items() if IDEFICS3.part_of(name) == "language" and "Linear" in kind]
    tower = [
        kind for name, kind in kinds.items() if IDEFICS3.part_of(name) in ("vision", "projector") and "Linear" in kind
    ]
    assert language and set(language) == {"Linear4bit"}
    assert tower and set(tower) == {"Linear"}  # the frozen tower and projector stay in the compute dtype
    qlora = config(idefics, colour_rows(tmp_path), tmp_path / "runs", max_steps=3)
    qlora.model.qlora = True
    events = list(run(qlora))
    losses = [e.loss for e in events if isinstance(e, StepMetrics)]
    assert len(losses) == 3 and all(loss == loss for loss in losses), [e for e in events if isinstance(e, RunFailed)]
    assert losses[-1] < losses[0]


def test_recompute_trains_the_same_steps_and_the_packed_text_switches_say_why_not(
    idefics: Path, tmp_path: Path
) -> None:
    data = colour_rows(tmp_path)
    runs = {}
    for mode in ("none", "standard"):
        settings = config(idefics, data, tmp_path / mode, max_steps=3)
        settings.speed.checkpointing = mode
        settings.speed.fused_loss = True
        runs[mode] = list(run(settings))
    losses = {mode: [e.loss for e in events if isinstance(e, StepMetrics)] for mode, events in runs.items()}
    assert len(losses["none"]) == 3
    assert losses["standard"] == pytest.approx(losses["none"], rel=1e-5)
    notes = {mode: " ".join(e.message for e in events if isinstance(e, Notice)) for mode, events in runs.items()}
    assert "activation checkpointing on" in notes["standard"] and "activation checkpointing off" in notes["none"]
    assert "fused loss is off for vision-language models: the loss comes from the model's own head" in notes["none"]


def test_the_session_trains_in_training_mode_with_the_recompute_it_asked_for(idefics: Path, tmp_path: Path) -> None:
    from engine.run.vision_session import start_vision
    from engine.vision.families import IDEFICS3

    settings = config(idefics, colour_rows(tmp_path), tmp_path / "runs", max_steps=1)
    settings.speed.checkpointing = "standard"
    starting = start_vision(settings, tmp_path, IDEFICS3)
    while True:
        try:
            next(starting)
        except StopIteration as done:
            session = done.value
            break
    assert session.model.training  # transformers skips the recompute in eval mode
    assert session.model.base_model.model.is_gradient_checkpointing


def test_a_non_finite_step_is_skipped_and_said(idefics: Path, tmp_path: Path) -> None:
    from engine.run.vision_loop import train_step
    from engine.run.vision_session import start_vision
    from engine.vision.families import IDEFICS3

    starting = start_vision(config(idefics, colour_rows(tmp_path), tmp_path / "runs", max_steps=2), tmp_path, IDEFICS3)
    while True:
        try:
            next(starting)
        except StopIteration as done:
            session = done.value
            break
    before = {name: p.detach().clone() for name, p in session.model.named_parameters() if p.requires_grad}
    head = session.model.base_model.model.lm_head.weight
    with torch.no_grad():
        head[0, 0] = float("nan")  # every logit row that reads it becomes NaN
    stepping = train_step(session)
    with pytest.raises(StopIteration) as done:
        next(stepping)  # a step that does not run short says nothing
    metrics = done.value.value
    assert metrics.loss != metrics.loss
    after = dict(session.model.named_parameters())
    assert all(torch.equal(before[name], after[name].detach()) for name in before)  # no update from a NaN step
