"""Loading a MoE checkpoint for QLoRA without its 16-bit weights ever being whole in memory.

transformers' ``from_pretrained`` with a ``BitsAndBytesConfig`` quantizes only ``nn.Linear`` layers
(``Bnb4BitHfQuantizer.param_needs_quantization`` asks for ``bnb.nn.Linear4bit``): the 3-D expert parameters are
loaded whole in the compute dtype onto the target device, ~57 GiB for Qwen3-30B-A3B. Sending them to the CPU
instead needs as much host memory, and a device map with several devices brings accelerate's dispatch hooks.

So a MoE model for QLoRA is built here: the skeleton is made on the meta device from its config, then each tensor
is read from the safetensors files (memory-mapped, one tensor at a time) and placed on the device:

* each decoder ``nn.Linear`` becomes a bitsandbytes NF4 ``Linear4bit`` (double quantization, as
  ``from_pretrained`` would make it);
* each experts module's 3-D weights are assembled on the device one layer at a time (from the fused
  ``experts.gate_up_proj`` tensors, or from per-expert ``experts.{j}.gate_proj.weight`` tensors as the Qwen-MoE
  hub checkpoints store them) and quantized to NF4 (:mod:`engine.model.quantized_experts`);
* embeddings, norms, routers and the head are loaded in the compute dtype.

Peak memory beyond the finished model is one layer's 16-bit expert weights on the device (1.2 GB for
Qwen3-30B-A3B) and a few MB of host memory per tensor read: a 24 GB card with 32 GB of RAM loads Qwen3-30B-A3B.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.model.quantized_experts import expert_weight_names, experts_modules, quantize_experts

PER_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
"""Per-expert checkpoint tensors that make each fused 3-D weight, concatenated along the output dimension."""


def meta_model(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> Any:
    """The model's skeleton on the meta device: its structure and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def has_experts(model: torch.nn.Module) -> bool:
    return bool(experts_modules(model))


class CheckpointTensors:
    """The tensors of a model's safetensors files by name, read one at a time."""

    def __init__(self, files: list[Path], handles: dict[Path, Any]) -> None:
        self._handles = handles
        self.where: dict[str, Path] = {}
        for file in files:
            for name in handles[file].keys():  # noqa: SIM118  # a safetensors handle is not iterable
                self.where[name] = file

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._handles[self.where[name]].get_tensor(name)
        return tensor


@contextmanager
def open_checkpoint(folder: Path) -> Iterator[CheckpointTensors]:
    from safetensors import safe_open

    files = _safetensors_files(folder)
    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in files}
        yield CheckpointTensors(files, handles)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors weights; 4-bit MoE experts are loaded from safetensors only"
        )
    return files


def load_quantized_moe(folder: Path, config: Any, device: torch.device, dtype: torch.dtype, **kwargs: Any) -> Any:
    """The model in ``folder`` with its linears and experts in NF4 on ``device``, the rest in ``dtype``."""
    from tqdm.auto import tqdm

    model = meta_model(config, dtype, trust_remote_code=kwargs.get("trust_remote_code", False))
    with open_checkpoint(folder) as tensors:
        layers = experts_modules(model)
        # reading and quantizing a 30B model's experts takes minutes: a bar in a terminal, silent elsewhere
        for parent, attribute, experts in tqdm(layers, desc="4-bit experts", unit="layer", disable=None):
            prefix = _name_of(model, experts)
            weights = {
                name: _expert_weight(tensors, prefix, name, experts, device, dtype)
                for name in expert_weight_names(experts)
            }
            parent._modules[attribute] = quantize_experts(experts, weights)
            del weights  # the next layer's 16-bit weights take their place
        _quantize_linears(model, tensors, device, dtype)
        _load_remaining(model, tensors, device, dtype)
    finish_on_device(model, device)
    model.is_loaded_in_4bit = True  # peft wraps Linear4bit layers with its 4-bit LoRA layer only when set
    model.eval()
    return model


def _name_of(model: torch.nn.Module, target: torch.nn.Module) -> str:
    name: str = next(name for name, module in model.named_modules() if module is target)
    return name


def _expert_weight(
    tensors: CheckpointTensors,
    prefix: str,
    name: str,
    experts: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One 3-D expert weight assembled on ``device``, from a fused tensor or from the per-expert tensors."""
    shape = tuple(experts._parameters[name].shape)  # type: ignore[union-attr]
    fused = f"{prefix}.{name}"
    if fused in tensors:
        return _checked(tensors.read(fused), fused, shape).to(device, dtype)
    parts = PER_EXPERT_PARTS.get(name)
    if parts is None or getattr(experts, "is_transposed", False) or f"{prefix}.0.{parts[0]}.weight" not in tensors:
        raise ModelLoadError(
            f"the checkpoint has no {fused} weights in a layout TuneDeck can quantize to 4-bit",
            hint="train this model with LoRA in 16-bit (no --qlora)",
        )
    weight = torch.empty(shape, device=device, dtype=dtype)
    for expert in range(shape[0]):
        rows = [tensors.read(f"{prefix}.{expert}.{part}.weight") for part in parts]
        weight[expert].copy_(_checked(torch.cat(rows), f"{prefix}.{expert}", shape[1:]))
    return weight


def _checked(tensor: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; the model expects {shape}")
    return tensor


def _read(tensors: CheckpointTensors, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in tensors:
        raise ModelLoadError(f"the checkpoint has no tensor {name}", hint="train this model without --qlora")
    return _checked(tensors.read(name), name, shape)


def nf4_linear(linear: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Any:
    """A bitsandbytes NF4 layer (double quantization, computing in ``dtype``) from a 16-bit weight on its device."""
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=bias is not None,
        compute_dtype=dtype,
        quant_type="nf4",
        device="meta",
    )
    param = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4", module=layer)
    layer.weight = param.to(weight.device)  # type: ignore[misc]  # bitsandbytes types .to()'s self as a Module
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer


def _quantize_linears(model: Any, tensors: CheckpointTensors, device: torch.device, dtype: torch.dtype) -> None:
    decoder = model.get_decoder()
    prefix = _name_of(model, decoder)
    for module_name, module in list(decoder.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            name = ".".join(part for part in (prefix, module_name, child_name) if part)
            weight = _read(tensors, f"{name}.weight", tuple(child.weight.shape)).to(device, dtype)
            bias = None
            if child.bias is not None:
                bias = _read(tensors, f"{name}.bias", tuple(child.bias.shape)).to(device, dtype)
            module._modules[child_name] = nf4_linear(child, weight, bias, dtype)


def _load_remaining(model: Any, tensors: CheckpointTensors, device: torch.device, dtype: torch.dtype) -> None:
    """Embeddings, norms, routers, biases and the head: every parameter still on the meta device."""
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    head_name = f"{_name_of(model, head)}.weight" if head is not None else None
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta" or (tied and name == head_name and name not in tensors):
            continue
        value = _read(tensors, name, tuple(param.shape)).to(device, dtype if param.is_floating_point() else None)
        owner, _, attribute = name.rpartition(".")
        model.get_submodule(owner)._parameters[attribute] = torch.nn.Parameter(value, requires_grad=False)
    if tied:
        model.tie_weights()


def finish_on_device(model: Any, device: torch.device) -> None:
    """Rebuild the modules whose buffers were computed on the meta device (rotary inverse frequencies)."""
    for parent in list(model.modules()):
        for attribute, child in list(parent.named_children()):
            if not any(buffer.device.type == "meta" for buffer in child.buffers(recurse=False)):
                continue
            if not hasattr(child, "inv_freq"):
                raise ModelLoadError(f"cannot place {type(child).__name__} on {device}: its buffers are not loaded")
            with torch.device(device):
                parent._modules[attribute] = type(child)(config=child.config)
