"""Every switch flipped in the middle of a run gives the same losses as a run that never flipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from speed_models import packed_batch, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController

BATCHES = [
    packed_batch(lengths, seed=i) for i, lengths in enumerate([(9, 20, 5), (30, 4), (12, 12, 12), (25, 7, 3, 9)])
]
BASE = SpeedConfig(metadata_cache=False, checkpointing="none", moe_routing="stock", fused_loss=False)
FLIPS = {
    "metadata_cache": True,
    "checkpointing": "offloaded",
    "moe_routing": "sync-free",
    "fused_loss": True,
}


def train(flip: str | None, steps: int = 4) -> list[float]:
    model = tiny_lora_model("qwen3_moe", experts=True, seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ctl = SpeedController(model, BASE, torch.device("cpu"))
    losses = []
    for i in range(steps):
        if flip is not None and i == steps // 2:
            ctl.apply(dataclasses.replace(BASE, **{flip: FLIPS[flip]}))
        batch = BATCHES[i % len(BATCHES)]
        inputs = ctl.model_inputs(batch)
        loss = ctl.loss(model, inputs, batch.labels, batch.trained_tokens, positions=batch.loss_positions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("flip", sorted(FLIPS))
def test_flipping_a_switch_mid_run_keeps_the_losses(flip: str) -> None:
    reference = train(None)
    flipped = train(flip)
    assert flipped == pytest.approx(reference, rel=1e-5, abs=1e-6)
