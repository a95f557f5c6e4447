"""A packed row must give every document exactly what it gets when run alone (float32, <= 1e-5)."""

from __future__ import annotations

import pytest
import torch
from speed_models import COMMON, VOCAB

from engine.data.model_inputs import stock_model_inputs
from engine.data.packing import IGNORE_INDEX, TokenizedExample, collate

CONFIGS = {
    "llama": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": None},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gpt_oss": {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def tiny_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **COMMON, **CONFIGS[model_type])
    if model_type == "gpt_oss":
        config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    return model


def documents(lengths: list[int]) -> list[TokenizedExample]:
    generator = torch.Generator().manual_seed(1)
    docs = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=generator).tolist()
        labels = [IGNORE_INDEX] * (n // 3) + ids[n // 3 :]  # prompt part untrained
        docs.append(TokenizedExample(tuple(ids), tuple(labels)))
    return docs


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_packed_row_equals_documents_alone(model_type: str) -> None:
    model = tiny_model(model_type)
    docs = documents([7, 19, 3, 12])  # gpt-oss window 8 < 19 exercises the sliding mask too
    batch = collate(docs)
    with torch.no_grad():
        packed = model(**stock_model_inputs(model, batch), labels=batch.labels, num_items_in_batch=batch.trained_tokens)
        alone_loss_sum = 0.0
        for index, doc in enumerate(docs):
            single = collate([doc])
            out = model(**stock_model_inputs(model, single), labels=single.labels, num_items_in_batch=1)
            lo, hi = int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1])
            torch.testing.assert_close(packed.logits[0, lo:hi], out.logits[0], atol=1e-5, rtol=1e-5)
            alone_loss_sum += float(out.loss)
    packed_sum = float(packed.loss) * batch.trained_tokens
    assert packed_sum == pytest.approx(alone_loss_sum, rel=1e-5)


def test_documents_leak_without_packing_metadata() -> None:
    """The check above can fail: with a cache (use_cache=True) transformers ignores the packing."""
    model = tiny_model("llama")
    docs = documents([6, 9])
    batch = collate(docs)
    with torch.no_grad():
        leaky = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True).logits
        alone = model(**stock_model_inputs(model, collate([docs[1]]))).logits
    assert not torch.allclose(leaky[0, 6:], alone[0], atol=1e-3)
