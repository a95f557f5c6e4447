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

from engine.config import ModelConfig, RunConfig
from engine.errors import ModelLoadError
from engine.model.load import _hub_kwargs, _load_error, prepare_quantized_for_training, resolve_model
from engine.vision.families import VisionFamily, family_of, frozen_parts, is_vision_config, lora_targets


def model_config_dict(config: ModelConfig, on_disk: bool = False) -> dict[str, Any] | None:
    """The model's ``config.json`` as a dict: a local folder's, or a hub model's (from the cache, or downloaded
    unless offline or ``on_disk``); None for a GGUF model, or where it cannot be read (the text path then says
    why)."""
    try:
        source = resolve_model(config.name)
        if source.is_local:
            path: Path | None = Path(source.location) / "config.json"
        elif on_disk:  # a file lookup: huggingface_hub's calls send a request even with local_files_only
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(source.location, "config.json")
            path = Path(found) if isinstance(found, str) else None
        else:
            from transformers.utils import cached_file

            found = cached_file(
                source.location, "config.json", _raise_exceptions_for_missing_entries=False, **_hub_kwargs(config)
            )
            path = Path(found) if found else None
        raw = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
    except Exception:  # a missing folder, an unreachable hub, a damaged file: the text path reports it
        return None
    return raw if isinstance(raw, dict) else None


def vision_family(model: ModelConfig, on_disk: bool = False) -> VisionFamily | None:
    """The vision family of the model, None for a text model; an unknown vision family is refused. ``on_disk``:
    read nothing from the network (a hub model not in the cache counts as a text model)."""
    config = model_config_dict(model, on_disk)
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
        settings = _processor_settings(location, config)
    except Exception:
        raise _processor_error(location, err) from err
    methods = {"check_argument_for_proper_class": _skip_absent, "save_pretrained": _save_parts}
    images_only = type(f"{processor_class.__name__}ForImages", (processor_class,), methods)
    return images_only(
        image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template,
        **settings,
    )  # fmt: skip


_PROCESSOR_CLASSES = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "smolvlm": "SmolVLMProcessor",
}
PROCESSOR_SETTINGS = ("image_seq_len",)
"""The processor's own settings (beside its parts) that an images-only processor keeps: SmolVLM's image tokens."""


def _processor_settings(location: str, config: ModelConfig) -> dict[str, Any]:
    """The settings of ``processor_config.json`` an images-only processor takes (none where there is no file)."""
    from transformers.utils import cached_file

    path = cached_file(
        location, "processor_config.json", _raise_exceptions_for_missing_entries=False, **_hub_kwargs(config)
    )
    raw = json.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    return {key: raw[key] for key in PROCESSOR_SETTINGS if key in raw}


def _skip_absent(self: Any, argument_name: str, argument: Any) -> Any:
    """The processor's own class check, except for a sub-processor that is absent (the video processor)."""
    if argument is None:
        return None
    return super(type(self), self).check_argument_for_proper_class(argument_name, argument)


def _save_parts(self: Any, folder: str | Path, **kwargs: Any) -> list[str]:
    """Save the parts an images-only processor has (the tokenizer with the chat template, the image processor) and
    its own settings."""
    self.tokenizer.chat_template = self.chat_template
    saved = [*self.tokenizer.save_pretrained(folder, **kwargs), *self.image_processor.save_pretrained(folder, **kwargs)]
    settings = {key: getattr(self, key) for key in PROCESSOR_SETTINGS if hasattr(self, key)}
    if settings:
        path = Path(folder) / "processor_config.json"
        path.write_text(json.dumps({"processor_class": type(self).__mro__[1].__name__, **settings}, indent=2) + "\n")
        saved.append(str(path))
    return saved


def _processor_error(location: str, err: Exception) -> ModelLoadError:
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ModelLoadError(f"cannot load the processor of {location}: {message}")


def load_vision_model(config: ModelConfig, family: VisionFamily, device: torch.device, dtype: torch.dtype) -> Any:
    """The frozen base model on ``device``; under QLoRA its language model in 4-bit NF4, the vision tower and
    projector left in ``dtype``."""
    from transformers import AutoModelForImageTextToText

    source = resolve_model(config.name, dtype)
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": True, **_hub_kwargs(config)}
    if config.qlora:
        kwargs["quantization_config"] = _quantization(dtype, family)
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForImageTextToText.from_pretrained(source.location, **kwargs)
    except Exception as err:
        raise _load_error(source, "model", err) from err
    if not config.qlora:
        model.to(device)  # type: ignore[arg-type]  # transformers' stubs type .to() for the module, not a device
    model.config.use_cache = False
    return model


def _quantization(dtype: torch.dtype, family: VisionFamily) -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=[*frozen_parts(family), "lm_head"],
    )


def with_lora(model: Any, family: VisionFamily, config: RunConfig, recompute: bool) -> Any:
    """``model`` frozen, with a fresh LoRA adapter on the language model's linear layers (and with
    ``vision.adapt_vision`` on the vision tower's and projector's too); transformers' recompute on with
    ``recompute`` (engine.vision.speed.choose_recompute)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if config.model.qlora:
        model = prepare_quantized_for_training(model, config_dtype(model))
    for param in model.parameters():
        param.requires_grad_(False)
    targets = _targets(model, family, config)
    if recompute:
        enable_recompute(model)
    sized = config.lora.sized()
    peft_config = PeftLoraConfig(
        r=sized.rank,
        lora_alpha=sized.alpha,  # type: ignore[arg-type]  # peft annotates int; a float alpha works
        lora_dropout=config.lora.dropout,
        target_modules=targets,
    )
    adapted = get_peft_model(model, peft_config)
    drop_input_gradients(model)  # peft adds them back for a model that recomputes
    return adapted


def enable_recompute(model: Any) -> None:
    """transformers' non-reentrant recompute on ``model`` (the PreTrainedModel under peft's wrapper), without the
    input gradients transformers switches on with it (:func:`drop_input_gradients`)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    drop_input_gradients(model)


def drop_input_gradients(model: Any) -> None:
    """Remove the hooks of transformers' ``enable_input_require_grads`` (which transformers and peft call when
    recompute is on). They mark the output of every sub-model's input embeddings as needing a gradient, the vision
    tower's patch embedding included, so a frozen tower would run a backward pass of its own and, recomputed, a
    second forward, for a gradient nothing uses. Non-reentrant recompute needs no input gradient: the LoRA weights
    inside each layer put it in the graph (as for text runs, engine.model.load.prepare_quantized_for_training)."""
    hooks = [*(getattr(model, "_require_grads_hooks", None) or []), getattr(model, "_require_grads_hook", None)]
    for hook in hooks:
        if hook is not None:
            hook.remove()
    model._require_grads_hooks = []
    if hasattr(model, "_require_grads_hook"):
        del model._require_grads_hook


def _targets(model: Any, family: VisionFamily, config: RunConfig) -> list[str]:
    modules = [(name, type(module).__name__) for name, module in model.named_modules()]
    targets = lora_targets(family, modules, config.vision.adapt_vision)
    wanted = config.lora.target_modules
    if wanted != ["all-linear"]:  # named projections (q_proj, v_proj...) within the parts LoRA adapts
        targets = [name for name in targets if name.rpartition(".")[2] in wanted]
    if not targets:
        raise ModelLoadError(
            f"no linear layer of this {family.label} model matches lora.target_modules {wanted}",
            hint="use all-linear, or names of the language model's projections (q_proj, v_proj...)",
        )
    return targets


def config_dtype(model: Any) -> torch.dtype:
    """The dtype the model computes in (its embeddings')."""
    return model.get_input_embeddings().weight.dtype  # type: ignore[no-any-return]
