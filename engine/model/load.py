"""Finding, loading and adapting the base model.

A model is the built-in demo, a local Hugging Face folder, or a hub id. Only safetensors weights are loaded
unless the user opts in to pickle-based ``.bin`` files (``model.allow_pickle_weights``: unpickling can run code),
repository code runs only when the user asked for it (``model.trust_remote_code``, nothing else turns it on),
and offline mode (``HF_HUB_OFFLINE=1``) is honoured with a message that says the model is not in the cache.
The adapter is LoRA through peft on every linear layer by
default; with QLoRA the frozen base is quantised to 4-bit NF4 by bitsandbytes (which also runs on CPU) and
prepared for training by :func:`prepare_quantized_for_training`, which keeps the rest of the base in the compute
dtype (peft's own preparation upcasts it to float32: 9.3 GiB for Llama-3.1-8B at 256 tokens, over an 8 GiB card).
A MoE model under QLoRA also gets its 3-D experts in NF4 (:mod:`engine.model.quantized_experts`), loaded tensor by
tensor from safetensors by :mod:`engine.model.moe_load` so its 16-bit weights are never whole on the GPU or in host
memory; its experts stay frozen and LoRA trains the attention projections (and any other linear layers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import DEMO_MODEL, LoraConfig, ModelConfig, demo_model_dir
from engine.errors import ModelLoadError
from engine.model.gguf_import import find_converted
from engine.model.local_sources import find_local_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a folder on disk, or a hub id to load through the cache."""

    location: str
    is_local: bool
    label: str


def resolve_model(name: str, dtype: torch.dtype | None = None) -> ModelSource:
    """Map the user's model name to a source, with a clear error for folders that are not models. A GGUF model
    (a .gguf file, an Ollama or LM Studio model) is its converted folder, in ``dtype`` where there is one."""
    if name == DEMO_MODEL:
        folder = demo_model_dir()
        if not (folder / "config.json").exists():
            raise ModelLoadError(f"the built-in demo model is missing from {folder}", hint="reinstall TuneDeck")
        return ModelSource(str(folder), True, "demo")
    local = find_local_model(name)
    if local is not None:
        converted = find_converted(local, dtype)
        if converted is None:
            raise ModelLoadError(
                f"{local.name} has not been converted from GGUF yet",
                hint="choose it on the Model page or start a run with it: its weights are converted once",
            )
        return ModelSource(str(converted), True, local.label)
    path = Path(name).expanduser()
    if path.exists():
        return ModelSource(str(path.resolve()), True, path.name)
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1:
        raise ModelLoadError(f"model folder not found: {name}")
    return ModelSource(name, False, name.split("/")[-1])


def _check_local_folder(folder: Path, allow_pickle: bool = False) -> None:
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is a file; a model is a folder with config.json and *.safetensors")
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"{folder} has no config.json: it is not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        pickled = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
        if pickled and allow_pickle:
            return
        hint = (
            "convert the weights to safetensors, or allow pickle weights (model.allow_pickle_weights, "
            "--allow-pickle-weights) if you trust the model: pickle-based .bin files can run code when loaded"
            if pickled
            else None
        )
        raise ModelLoadError(f"{folder} has no *.safetensors weights", hint=hint)


def hub_offline() -> bool:
    """True when the user switched the Hugging Face hub off (``HF_HUB_OFFLINE=1``): nothing may be downloaded."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError) as err:
        raise ModelLoadError(
            f"training.device: {requested!r} is not a device", hint="use auto, cpu, cuda or cuda:N"
        ) from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("a CUDA device was requested but torch sees no GPU", hint="use --device cpu or auto")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU (unless the user chose)."""
    if requested != "auto":
        return DTYPES[requested]
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _hub_kwargs(config: ModelConfig) -> dict[str, Any]:
    # trust_remote_code comes from the user's setting only; the token is left to huggingface_hub (never passed).
    return {
        "revision": config.revision,
        "trust_remote_code": config.trust_remote_code is True,
        "local_files_only": hub_offline(),
    }


def _load_error(source: ModelSource, what: str, err: Exception) -> ModelLoadError:
    if source.is_local:
        return ModelLoadError(f"cannot load the {what} from {source.location}: {str(err).splitlines()[0]}")
    if hub_offline():
        return ModelLoadError(
            f"'{source.location}' is not in the local Hugging Face cache and offline mode is on",
            hint="download it once while online, or unset HF_HUB_OFFLINE",
        )
    return ModelLoadError(
        f"cannot load the {what} of '{source.location}' from the hub: {str(err).splitlines()[0]}",
        hint="check the model id, your network, and (for gated models) your Hugging Face token",
    )


def load_tokenizer(config: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    source = resolve_model(config.name)
    if source.is_local:
        _check_local_folder(Path(source.location), config.allow_pickle_weights)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **_hub_kwargs(config))
    except Exception as err:  # transformers raises OSError, ValueError, HTTP errors...
        raise _load_error(source, "tokenizer", err) from err
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"the tokenizer of {source.label} is not a fast tokenizer; TuneDeck needs tokenizer.json")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _quantization_config(dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )


def load_base_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The frozen base model on ``device`` (4-bit NF4 with QLoRA)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(config.name, dtype)
    if source.is_local:
        _check_local_folder(Path(source.location), config.allow_pickle_weights)
    # use_safetensors=None: safetensors when present, else the .bin files the user allowed
    safetensors_only = True if not config.allow_pickle_weights else None
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": safetensors_only, **_hub_kwargs(config)}
    if config.qlora:
        kwargs["quantization_config"] = _quantization_config(dtype)
        kwargs["device_map"] = {"": device}
    moe_config = _moe_config(source, config, dtype) if config.qlora else None
    model: PreTrainedModel
    try:
        if moe_config is not None:
            model = _load_quantized_moe(source, config, moe_config, device, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except ModelLoadError:
        raise
    except Exception as err:
        raise _load_error(source, "model", err) from err
    if not config.qlora:
        model.to(device)  # type: ignore[arg-type]  # transformers' stubs type .to() for the module, not a device
    model.config.use_cache = False
    return model


def _moe_config(source: ModelSource, config: ModelConfig, dtype: torch.dtype) -> Any | None:
    """The model's config when it has 3-D MoE experts, else None: a config that names no experts is dense; one
    that does is checked on a meta-device skeleton."""
    from transformers import AutoConfig

    from engine.errors import ConfigError
    from engine.hardware.shapes import ModelShape
    from engine.model.moe_load import has_experts, meta_model

    try:
        model_config = AutoConfig.from_pretrained(source.location, **_hub_kwargs(config))
        try:
            if not ModelShape.from_config_dict(model_config.to_dict(), config.name).is_moe:
                return None
        except ConfigError:
            pass  # an unusual config: let the skeleton tell
        skeleton = meta_model(model_config, dtype, trust_remote_code=config.trust_remote_code is True)
    except Exception as err:
        raise _load_error(source, "model", err) from err
    return model_config if has_experts(skeleton) else None


def _load_quantized_moe(
    source: ModelSource, config: ModelConfig, model_config: Any, device: torch.device, dtype: torch.dtype
) -> Any:
    from engine.model.moe_load import load_quantized_moe

    folder = Path(source.location) if source.is_local else _hub_snapshot(source, config)
    return load_quantized_moe(folder, model_config, device, dtype, trust_remote_code=config.trust_remote_code is True)


def _hub_snapshot(source: ModelSource, config: ModelConfig) -> Path:
    """The hub model's config and safetensors files in the local cache (downloaded unless offline)."""
    from huggingface_hub import snapshot_download

    kwargs = _hub_kwargs(config)
    return Path(
        snapshot_download(
            source.location,
            revision=kwargs["revision"],
            allow_patterns=["*.json", "*.safetensors"],
            local_files_only=kwargs["local_files_only"],
        )
    )


def lora_targets(lora: LoraConfig) -> str | list[str]:
    return "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)


def _is_quantized(param: torch.nn.Parameter) -> bool:
    return param.__class__.__name__ == "Params4bit" or not param.is_floating_point()


def prepare_quantized_for_training(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Freeze a 4-bit base and keep its embeddings, norms and head in the compute ``dtype``.

    peft's ``prepare_model_for_kbit_training`` upcasts every non-4-bit weight to float32. For Llama-3.1-8B that
    doubles the 2 GiB of embeddings and head, and because the norms then output float32, the whole residual
    stream and every saved activation become float32 as well (twice the activations, and the 16-bit attention
    kernels cannot run). The frozen weights gain nothing from float32: nothing updates them, and the 4-bit
    matmuls compute in ``dtype`` anyway. RMSNorm still computes its statistics in float32 internally.

    Input gradients are not switched on (peft does that for reentrant checkpointing, whose recompute needs an
    input that requires grad): TuneDeck's checkpointing is non-reentrant and its offloaded mode carries its own
    anchor, so a gradient for the embedding output (tokens x hidden) would only cost memory.

    The LoRA weights that :func:`add_lora` adds next stay float32 (peft's ``autocast_adapter_dtype``): they are
    the only weights the optimizer updates, and 16-bit weights would round away updates smaller than 1/256 of a
    weight (AdamW's ``lr`` x step is far smaller). Their float32 copies of each adapted layer's input grow with
    the sequence; the chunked-MLP switch (:mod:`engine.speed.chunked_mlp`) bounds those during recompute.
    """
    for param in model.parameters():
        param.requires_grad_(False)
        if not _is_quantized(param) and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def add_lora(model: torch.nn.Module, lora: LoraConfig, qlora: bool) -> Any:
    """Wrap ``model`` with a fresh LoRA adapter (peft); only the adapter is trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if qlora:
        model = prepare_quantized_for_training(model, _compute_dtype(model))
    _check_targets_outside_experts(model, lora)
    peft_config = PeftLoraConfig(
        r=lora.sized().rank,
        lora_alpha=lora.sized().alpha,  # type: ignore[arg-type]  # peft annotates int; a float alpha works
        lora_dropout=lora.dropout,
        target_modules=_targets_for(model, lora),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_config)
    except ValueError as err:
        raise ModelLoadError(f"cannot add LoRA: {err}", hint="check lora.target_modules") from err


def _targets_for(model: torch.nn.Module, lora: LoraConfig) -> str | list[str]:
    """The LoRA targets; with 4-bit experts, 'all-linear' becomes the model's linear layers by name."""
    from engine.model.quantized_experts import linear_targets_outside_experts, quantized_experts_of

    targets = lora_targets(lora)
    if targets == "all-linear" and quantized_experts_of(model):
        return linear_targets_outside_experts(model)
    return targets


def _check_targets_outside_experts(model: torch.nn.Module, lora: LoraConfig) -> None:
    """4-bit experts are frozen: a LoRA target naming a module inside them is refused with a clear message."""
    from engine.model.quantized_experts import quantized_experts_of

    inside = {
        name.rpartition(".")[2]
        for experts in quantized_experts_of(model)
        for name, _ in experts.named_modules()
        if name
    }
    inside.add("experts")
    hit = sorted(set(lora.target_modules) & inside) if quantized_experts_of(model) else []
    if hit:
        raise ModelLoadError(
            f"cannot put LoRA on {', '.join(hit)}: this model's MoE experts are 4-bit and frozen under QLoRA",
            hint="LoRA trains the attention projections and other linear layers; use all-linear",
        )


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the 4-bit layers compute in (bitsandbytes' ``compute_dtype``), else the embeddings' dtype."""
    for module in model.modules():
        compute = getattr(module, "compute_dtype", None)
        if isinstance(compute, torch.dtype):
            return compute
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_input_embeddings() if get_input_embeddings is not None else None
    return embeddings.weight.dtype if embeddings is not None else torch.float32


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as their unpacked size."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":
            n *= 2
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total
