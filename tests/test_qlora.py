"""QLoRA preparation: the 4-bit base keeps its other weights in the compute dtype and trains like peft's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_model
from speed_models import VOCAB, grads, max_relative_error, packed_batch

from engine.config import LoraConfig, ModelConfig
from engine.data.model_inputs import stock_model_inputs
from engine.model.load import add_lora, load_base_model

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qlora")
    build_model(folder, VOCAB)
    return folder


def quantized(folder: Path) -> torch.nn.Module:
    return load_base_model(ModelConfig(name=str(folder), qlora=True), torch.device("cpu"), torch.bfloat16)


def peft_prepared(folder: Path, lora: LoraConfig) -> Any:
    """The preparation TuneDeck used before: peft's, which upcasts the non-4-bit weights to float32."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    base = prepare_model_for_kbit_training(quantized(folder), use_gradient_checkpointing=False)
    config = PeftLoraConfig(
        r=lora.sized().rank,
        lora_alpha=lora.sized().alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, config)


def loss_and_grads(model: Any, seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    batch = packed_batch((40, 30, 20), seed=seed)
    model.zero_grad(set_to_none=True)
    loss = model(**stock_model_inputs(model, batch), labels=batch.labels, num_items_in_batch=batch.trained_tokens).loss
    loss.backward()
    return float(loss.detach()), grads(model)


def test_base_stays_in_the_compute_dtype_and_only_lora_trains(tiny_dir: Path) -> None:
    model = add_lora(quantized(tiny_dir), LoraConfig(rank=8), qlora=True)
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad and p.dtype == torch.float32 for p in lora.values())
    assert not any(p.requires_grad for p in base.values())
    assert {p.dtype for p in base.values()} == {torch.uint8, torch.bfloat16}  # 4-bit codes and 16-bit rest
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())


def test_quantized_model_trains(tiny_dir: Path) -> None:
    torch.manual_seed(0)
    model = add_lora(quantized(tiny_dir), LoraConfig(rank=8), qlora=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss, _ = loss_and_grads(model)  # the same batch: the loss must fall
        optimizer.step()
        losses.append(loss)
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0] - 0.05, losses


def test_matches_the_float32_upcast_preparation_within_bf16_noise(tiny_dir: Path) -> None:
    lora = LoraConfig(rank=8, dropout=0.0)
    old = peft_prepared(tiny_dir, lora)
    new = add_lora(quantized(tiny_dir), lora, qlora=True)
    torch.manual_seed(1)
    old_lora = dict(old.named_parameters())
    with torch.no_grad():
        for name, param in new.named_parameters():
            if "lora_B" in name:  # nonzero B, so every LoRA factor gets a gradient
                torch.nn.init.normal_(param, std=0.02)
            if "lora_" in name:
                old_lora[name].copy_(param)  # the same adapter in both
    old_loss, old_grads = loss_and_grads(old)
    new_loss, new_grads = loss_and_grads(new)
    assert new_loss == pytest.approx(old_loss, rel=1e-2)
    assert max_relative_error(new_grads, old_grads) < 5e-2  # bf16 residual stream vs float32: noise, not bias
    # and the comparison can fail: a different batch gives a different loss
    assert loss_and_grads(new, seed=1)[0] != pytest.approx(old_loss, rel=1e-3)
