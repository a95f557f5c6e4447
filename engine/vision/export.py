"""Exporting a vision-language fine-tune: the adapter and the merged model as for text; GGUF refused with why.

The merged model is the base loaded as an image-text-to-text model in float32 with the adapter folded in, saved
with its processor (tokenizer, image processor, chat template), so it loads with ``AutoModelForImageTextToText``
and ``AutoProcessor`` and answers about pictures without peft. GGUF is refused: llama.cpp runs these families as
two files, the language model and a separate multimodal projector (``mmproj``) holding the vision tower, each
family converted by llama.cpp's own script; TuneDeck's GGUF writer writes a text model's single file, and the
language model alone would answer without seeing the image.
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


def refuse_gguf(family: VisionFamily) -> TuneDeckError:
    return TuneDeckError(
        f"{family.label} models are not exported to GGUF here: llama.cpp runs them as the language model plus a "
        "separate vision projector file (mmproj), converted per family by llama.cpp's own script, and a GGUF of "
        "the language model alone would answer without seeing the image",
        hint="export the merged model (--merged), then convert it with llama.cpp's convert_hf_to_gguf.py, once "
        "as the model and once with --mmproj, where llama.cpp supports the family",
    )


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
