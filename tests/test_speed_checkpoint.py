"""Offloaded checkpointing: gradients equal standard checkpointing's, with synchronous copies on CPU."""

from __future__ import annotations

import pytest
import torch
from speed_models import grads, max_relative_error, packed_batch, step, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController
from engine.speed.offloaded_checkpoint import ActivationOffloader

LENGTHS = (11, 25, 8, 20)


def run(model: torch.nn.Module, checkpointing: str, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = packed_batch(LENGTHS)
    ctl = SpeedController(model, SpeedConfig(metadata_cache=True, checkpointing=checkpointing), torch.device("cpu"))
    assert ctl.state()["checkpointing"]["mode"] == checkpointing
    torch.manual_seed(seed)
    loss, _ = step(model, ctl.model_inputs(batch), batch)
    return loss, grads(model)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_offloaded_gradients_equal_standard(dropout: float) -> None:
    """With LoRA dropout the recompute must replay the forward's random masks."""
    model = tiny_lora_model("qwen3", dropout=dropout)
    loss_std, grads_std = run(model, "standard")
    loss_off, grads_off = run(model, "offloaded")
    loss_none, grads_none = run(model, "none")
    assert torch.allclose(loss_off, loss_std, rtol=1e-6) and torch.allclose(loss_none, loss_std, rtol=1e-6)
    assert max_relative_error(grads_off, grads_std) <= 1e-6
    assert max_relative_error(grads_none, grads_std) <= 1e-5


def test_offloader_fetches_in_reverse_and_reuses_host_buffers() -> None:
    offloader = ActivationOffloader(torch.device("cpu"), min_offload_bytes=0)
    inputs = [torch.randn(3, 5) for _ in range(4)]
    slots = [offloader.stash(x) for x in inputs]
    buffers = [b.tensor for b in offloader._buffers]
    for slot, x in zip(reversed(slots), reversed(inputs), strict=True):
        assert torch.equal(offloader.fetch(slot), x)
    assert not offloader._pending
    offloader.begin_batch()
    offloader.stash(torch.randn(3, 5))
    assert offloader._buffers[0].tensor is buffers[0]  # same host memory next step


def test_small_inputs_fall_back_to_recompute() -> None:
    calls: list[str] = []
    offloader = ActivationOffloader(torch.device("cpu"), min_offload_bytes=1 << 30)
    x = torch.randn(2, 3, requires_grad=True)
    out = offloader.checkpoint(lambda h: calls.append("run") or h * h, x)
    out.sum().backward()
    assert not offloader._pending and calls == ["run", "run"]  # standard recompute, nothing stashed
    assert torch.allclose(x.grad, 2 * x)
