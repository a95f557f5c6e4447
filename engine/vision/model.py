"""Loading a vision-language model, its processor and its LoRA adapter.

The processor comes from the model folder through ``AutoProcessor``. Qwen-VL's processor also holds a video
processor, which transformers builds only where torchvision is installed; without it TuneDeck builds the same
processor for images alone (its tokenizer, image processor and chat template), which is all a picture-and-text
run uses. The model loads as ``AutoModelForImageTextToText``; under QLoRA only the language model is quantised
(the vision tower and projector stay in the compute dtype, :func:`engine.vision.families.frozen_parts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.config import LoraConfig, ModelConfig
from engine.errors import ModelLoadError
from engine.model.load import _hub_kwargs, _load_error, prepare_quantized_for_training, resolve_model
from engine.vision.families import VisionFamily, family_of, frozen_parts, is_vision_config, lora_targets


def model_config_dict(name: str) -> dict[str, Any] | None:
    """The ``config.json`` of a local model folder (None for a hub id, a GGUF file or an unreadable folder)."""
    try:
        source = resolve_model(name)
    except ModelLoadError:
        return None
    path = Path(source.location) / "config.json"
    if not source.is_local or not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def vision_family(name: str) -> VisionFamily | None:
    """The vision family of the model ``name`` names, None for a text model; an unknown vision family is refused."""
    config = model_config_dict(name)
    if config is None or not is_vision_config(config):
        return None
    return family_of(config)


def load_processor(config: ModelConfig) -> Any:
    """The model's processor (tokenizer, image processor, chat template), right-padding, with a pad token."""
    from transformers import AutoProcessor

    source = resolve_model(config.name)
    try:
        processor = AutoProcessor.from_pretrained(source.location, **_hub_kwargs(config))
    except Exception as err:
        processor = _images_only_processor(source.location, config, err)
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(processor, "chat_template", None) is None and getattr(tokenizer, "chat_template", None):
        processor.chat_template = tokenizer.chat_template
    if not getattr(processor, "chat_template", None):
        raise ModelLoadError(
            f"{source.label} has no chat template: a vision-language model needs one to place its images",
            hint="use the instruct version of the model, whose folder holds chat_template.json or .jinja",
        )
    return processor


def _images_only_processor(location: str, config: ModelConfig, err: Exception) -> Any:
    """The model's processor built without its video processor (which needs torchvision), where its class allows."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, processing_utils

    try:
        model_type = AutoConfig.from_pretrained(location, **_hub_kwargs(config)).model_type
        processor_class = getattr(processing_utils.transformers_module, _PROCESSOR_CLASSES[model_type])
        tokenizer = AutoTokenizer.from_pretrained(location, **_hub_kwargs(config))
        images = AutoImageProcessor.from_pretrained(location, backend="pil", **_hub_kwargs(config))
    except Exception:
        raise _processor_error(location, err) from err
    images_only = type(
        f"{processor_class.__name__}ForImages", (processor_class,), {"check_argument_for_proper_class": _skip_absent}
    )
    return images_only(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


_PROCESSOR_CLASSES = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
}


def _skip_absent(self: Any, argument_name: str, argument: Any) -> Any:
    """The processor's own class check, except for a sub-processor that is absent (the video processor)."""
    if argument is None:
        return None
    return super(type(self), self).check_argument_for_proper_class(argument_name, argument)


def _processor_error(location: str, err: Exception) -> ModelLoadError:
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ModelLoadError(f"cannot load the processor of {location}: {message}")
