"""Exporting a vision-language fine-tune: the adapter and the merged model as for text (GGUF:
engine.export.vision_gguf).

The merged model is the base loaded as an image-text-to-text model in float32 with the adapter folded in, saved
with its processor (tokenizer, image processor, chat template), so it loads with ``AutoModelForImageTextToText``
and ``AutoProcessor`` and answers about pictures without peft.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.config import RunConfig
from engine.errors import TuneDeckError
from engine.vision.families import VisionFamily
from engine.vision.model import vision_family


def run_vision_family(run_folder: Path) -> VisionFamily | None:
    """The vision family of a run's base model (None for a text run, or where the base cannot be read)."""
    try:
        return vision_family(RunConfig.load(run_folder / "config.json").model)
    except TuneDeckError:
        return None


def merged_vision_model(run_folder: Path, adapter_folder: Path, family: VisionFamily) -> tuple[Any, Any]:
    """(model, processor): the base in float32 on the CPU with the adapter merged in."""
    import torch
    from peft import PeftModel

    from engine.vision.model import load_processor, load_vision_model

    config = RunConfig.load(run_folder / "config.json")
    model_config = dataclasses.replace(config.model, qlora=False)
    base = load_vision_model(model_config, family, torch.device("cpu"), torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_folder)).merge_and_unload()
    return merged, load_processor(model_config)
