"""The frozen input embedding in host memory: same outputs, refused where the table trains or is tied."""

from __future__ import annotations

import dataclasses

import torch
from speed_models import packed_batch, step, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController
from engine.speed.host_embedding import HostEmbedding, unsupported_reason

BASE = SpeedConfig(metadata_cache=False, checkpointing="none", moe_routing="stock", fused_loss=False)
BATCH = packed_batch((11, 7))


def hf(model: torch.nn.Module) -> torch.nn.Module:
    return model.base_model.model  # type: ignore[return-value]


def test_only_a_frozen_untied_table_moves() -> None:
    assert unsupported_reason(hf(tiny_lora_model("llama"))) is None
    assert "tied" in (unsupported_reason(hf(tiny_lora_model("llama", tie_word_embeddings=True))) or "")
    trained = tiny_lora_model("llama")
    hf(trained).get_input_embeddings().weight.requires_grad_(True)
    assert "trained" in (unsupported_reason(hf(trained)) or "")


def test_opt_in_and_gpu_only() -> None:
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, BASE, torch.device("cpu"))
    assert ctl.state()["host_embedding"]["on"] is False and "opt in" in ctl.state()["host_embedding"]["reason"]
    ctl.apply(dataclasses.replace(BASE, host_embedding=True))
    assert ctl.state()["host_embedding"] == {"on": False, "reason": "the model already lives in host memory"}
    gpu = HostEmbedding(hf(model), torch.device("cuda"))
    assert gpu.resolve(True)[0] is True and gpu.resolve(None)[0] is False


def test_hooks_give_the_same_loss_and_gradients_and_come_off_again() -> None:
    model = tiny_lora_model("llama", seed=2)
    ctl = SpeedController(model, BASE, torch.device("cpu"))
    ref_loss, ref_logits = step(model, ctl.model_inputs(BATCH), BATCH)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    embedding = HostEmbedding(hf(model), torch.device("cpu"))  # the hooks run; on CPU both sides are the host
    embedding.install()
    embedding.install()
    table = hf(model).get_input_embeddings()
    assert len(table._forward_pre_hooks) == 1 and len(table._forward_hooks) == 1
    loss, logits = step(model, ctl.model_inputs(BATCH), BATCH)
    assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits)
    assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.grad is not None)
    embedding.remove()
    assert not table._forward_pre_hooks and not table._forward_hooks and not embedding.on
