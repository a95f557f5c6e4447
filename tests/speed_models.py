"""Tiny models and packed batches for the speed-switch tests (built from configs, never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.packing import PackedBatch, TokenizedExample, collate

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    settings: dict[str, Any] = dict(COMMON)
    if model_type == "qwen3_moe":
        settings.update(MOE)
    elif model_type == "mixtral":
        settings.update(num_local_experts=8, num_experts_per_tok=2)
    elif model_type == "gpt_oss":
        settings.update(num_local_experts=8, num_experts_per_tok=2, head_dim=16, intermediate_size=32)
    settings.update(overrides)
    return AutoConfig.for_model(model_type, **settings)


def tiny_lora_model(
    model_type: str, seed: int = 0, experts: bool = False, dropout: float = 0.0, **overrides: Any
) -> Any:
    """A 2-layer model with LoRA on every linear layer (and on the 3-D experts when asked), in float32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    for name, param in model.named_parameters():
        if "experts" in name and name.endswith("bias"):
            torch.nn.init.normal_(param, std=0.1)  # gpt-oss expert biases start at zero: make them matter
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules="all-linear",
        target_parameters=EXPERT_PARAMETERS if experts else None,
        init_lora_weights=False,  # nonzero B, so every LoRA factor gets a gradient
    )
    peft_model = get_peft_model(model, lora)
    peft_model.train()
    return peft_model


def mixed_precision_lora_model(model_type: str, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Any:
    """:func:`tiny_lora_model` with base weights in ``dtype`` and LoRA weights in float32: what peft builds on a
    16-bit checkpoint."""
    model = tiny_lora_model(model_type, **overrides)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(dtype)
    return model


def tiny_qlora_model(folder: Path) -> Any:
    """The tiny checkpoint in ``folder`` loaded in NF4 on the CPU with LoRA r8 (nonzero B, so every LoRA factor gets
    a gradient); skips without bitsandbytes."""
    pytest.importorskip("bitsandbytes")
    from engine.config import LoraConfig, ModelConfig
    from engine.model.load import add_lora, load_base_model

    base = load_base_model(ModelConfig(name=str(folder), qlora=True), torch.device("cpu"), torch.bfloat16)
    torch.manual_seed(0)
    model = add_lora(base, LoraConfig(rank=8), qlora=True)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    model.train()
    return model


def packed_batch(lengths: tuple[int, ...], seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())
        docs.append(TokenizedExample(ids, ids))
    return collate(docs)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


def step(model: Any, inputs: dict[str, Any], batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward; returns (loss, logits)."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=batch.labels, num_items_in_batch=batch.trained_tokens)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach()
