"""4-bit MoE experts: same results as the dequantized weights, no 16-bit copy kept, and a real QLoRA load."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_model
from speed_models import VOCAB, packed_batch

from engine.config import LoraConfig, ModelConfig
from engine.data.model_inputs import stock_model_inputs
from engine.errors import ModelLoadError
from engine.model.load import add_lora, load_base_model
from engine.model.quantized_experts import (
    QuantizedExperts,
    experts_notice,
    quantize_experts,
    quantize_model_experts,
    quantized_experts_of,
)
from engine.speed import moe_routing

pytest.importorskip("bitsandbytes")

TINY_MOE = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
ROUTING = {"stock": "eager", "grouped_mm": "grouped_mm", **moe_routing.IMPLEMENTATION_NAMES}


def tiny_moe(dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, **TINY_MOE)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def experts_inputs(dtype: torch.dtype = torch.float32, tokens: int = 24) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, TINY_MOE["hidden_size"], generator=gen, dtype=dtype).requires_grad_()
    index = torch.randint(0, TINY_MOE["num_experts"], (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen, dtype=dtype).requires_grad_()
    return hidden, index, weights


def run(experts: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    hidden, index, weights = (t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    out = experts(hidden, index, weights)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out.detach(), hidden.grad, weights.grad


def with_dequantized_weights(quantized: QuantizedExperts, original: torch.nn.Module) -> torch.nn.Module:
    """The original 16-bit experts module holding exactly the weights the 4-bit one dequantizes to."""
    reference = copy.deepcopy(original)
    for name in quantized.weight_names:
        weight = quantized.nf4(name).dequantize()
        setattr(reference, name, torch.nn.Parameter(weight, requires_grad=False))
    return reference


@pytest.fixture(autouse=True)
def registered() -> None:
    moe_routing.register_experts_implementations()


def test_output_and_input_gradient_equal_the_dequantized_reference() -> None:
    model = tiny_moe()
    original = model.model.layers[0].mlp.experts
    quantized = quantize_experts(copy.deepcopy(original))
    reference = with_dequantized_weights(quantized, original)
    inputs = experts_inputs()
    for got, want in zip(run(quantized, inputs), run(reference, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_close_to_the_original_weights_within_nf4_error() -> None:
    model = tiny_moe()
    original = model.model.layers[0].mlp.experts
    quantized = quantize_experts(copy.deepcopy(original))
    for name in quantized.weight_names:
        full = getattr(original, name).detach()
        error = (quantized.nf4(name).dequantize() - full).norm() / full.norm()
        assert 0 < error < 0.15, (name, float(error))  # NF4: 16 levels per block of 64
    out, grad_hidden, _ = run(quantized, experts_inputs())
    want, want_grad, _ = run(original, experts_inputs())
    # two NF4 projections in a row: ~0.1 each; unrelated weights would be off by ~1.4
    assert float((out - want).norm() / want.norm()) < 0.25
    assert float((grad_hidden - want_grad).norm() / want_grad.norm()) < 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_routing_mode_gives_the_same_result(dtype: torch.dtype) -> None:
    model = tiny_moe(dtype)
    quantized = quantize_experts(model.model.layers[0].mlp.experts)
    inputs = experts_inputs(dtype)
    results = {}
    for mode, implementation in ROUTING.items():
        model.set_experts_implementation(implementation)
        results[mode] = run(quantized, inputs)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for mode, result in results.items():
        for got, want in zip(result, results["stock"], strict=True):
            torch.testing.assert_close(got, want, **tolerance, msg=lambda m, mode=mode: f"{mode}: {m}")


def test_no_16bit_expert_weight_is_left_after_quantization() -> None:
    model = tiny_moe()
    full = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 3)
    assert quantize_model_experts(model) == TINY_MOE["num_hidden_layers"]
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    layers = quantized_experts_of(model)
    stored = sum(layer.storage_bytes() for layer in layers)
    assert stored < full / 7  # 4 bits and the block statistics against float32
    assert all(not hasattr(layer.base, name) for layer in layers for name in layer.weight_names)
    assert moe_routing.has_routable_experts(model)
    notice = experts_notice(model)
    assert notice is not None and "LoRA trains the attention projections" in notice


def largest_saved(experts: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the largest storage a tensor saved for backward keeps alive (a per-expert slice keeps the whole
    3-D weight)."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.untyped_storage().nbytes())
        return tensor

    hidden, index, weights = (t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = experts(hidden, index, weights)  # what stays alive between forward and backward
    out.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    return max(sizes)


@pytest.mark.parametrize("mode", list(ROUTING))
def test_backward_keeps_no_dequantized_weight(mode: str) -> None:
    model = tiny_moe()
    model.set_experts_implementation(ROUTING[mode])
    original = model.model.layers[0].mlp.experts
    quantized = quantize_experts(copy.deepcopy(original))
    reference = with_dequantized_weights(quantized, original)
    inputs = experts_inputs()
    smallest_weight = min(torch.Size(quantized.nf4(name).shape).numel() * 4 for name in quantized.weight_names)
    assert largest_saved(reference, inputs) >= smallest_weight  # a 16-bit module saves its weights
    assert largest_saved(quantized, inputs) < smallest_weight


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-moe")
    build_model(folder, VOCAB, model_type="qwen3_moe", **TINY_MOE)
    return folder


def load_qlora(folder: Path) -> Any:
    return load_base_model(ModelConfig(name=str(folder), qlora=True), torch.device("cpu"), torch.bfloat16)


def test_qlora_load_gives_4bit_experts_and_4bit_linears(moe_dir: Path) -> None:
    model = load_qlora(moe_dir)
    assert len(quantized_experts_of(model)) == TINY_MOE["num_hidden_layers"]
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]  # fails if the experts stayed 16-bit
    assert not [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert {p.dtype for p in model.parameters()} == {torch.uint8, torch.bfloat16}


def test_qlora_load_equals_transformers_load_with_experts_quantized_afterwards(moe_dir: Path) -> None:
    """Every tensor reaches the same place as in from_pretrained (per-expert checkpoint tensors included)."""
    from transformers import AutoModelForCausalLM

    from engine.model.load import _quantization_config

    stock = AutoModelForCausalLM.from_pretrained(
        str(moe_dir), dtype=torch.bfloat16, quantization_config=_quantization_config(torch.bfloat16)
    )
    quantize_model_experts(stock)
    ours = load_qlora(moe_dir)
    batch = packed_batch((20, 12), seed=3)
    with torch.no_grad():
        want = stock(**stock_model_inputs(stock, batch)).logits
        got = ours(**stock_model_inputs(ours, batch)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_qlora_moe_trains_lora_on_attention_only(moe_dir: Path) -> None:
    torch.manual_seed(0)
    model = add_lora(load_qlora(moe_dir), LoraConfig(rank=8), qlora=True)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("self_attn" in n for n in lora)
    optimizer = torch.optim.AdamW(list(lora.values()), lr=1e-2)
    batch = packed_batch((40, 30, 20), seed=0)
    losses = []
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        out = model(**stock_model_inputs(model, batch), labels=batch.labels, num_items_in_batch=batch.trained_tokens)
        out.loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)
        optimizer.step()
        losses.append(float(out.loss.detach()))
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0] - 0.05, losses


def test_lora_is_refused_on_4bit_experts(moe_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="4-bit and frozen"):
        add_lora(load_qlora(moe_dir), LoraConfig(rank=8, target_modules=["q_proj", "experts"]), qlora=True)
