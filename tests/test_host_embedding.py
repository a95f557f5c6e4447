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


def test_gpu_only_and_automatic_where_the_table_is_a_large_share_of_memory() -> None:
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, BASE, torch.device("cpu"))
    assert ctl.state()["host_embedding"] == {"on": False, "reason": "the model already lives in host memory"}
    ctl.apply(dataclasses.replace(BASE, host_embedding=True))
    assert ctl.state()["host_embedding"] == {"on": False, "reason": "the model already lives in host memory"}
    gpu = HostEmbedding(hf(model), torch.device("cuda"))
    table = gpu.table_bytes()
    assert table == 256 * 64 * 4
    assert gpu.resolve(True)[0] is True and gpu.resolve(False)[0] is False
    assert gpu.resolve(None, usable_bytes=None)[0] is False
    assert gpu.resolve(None, usable_bytes=table * 100)[0] is False  # 1% of the card
    on, reason = gpu.resolve(None, usable_bytes=table * 5)  # 20% of the card, as 8B on an 8 GiB card (13%)
    assert on and "20% of GPU memory" in reason


def test_staged_host_ids_are_used_instead_of_copying_back() -> None:
    """The batch keeps its host ids when moved, and the lookup uses them: no device->host copy (a sync)."""
    model = tiny_lora_model("llama")
    embedding = HostEmbedding(hf(model), torch.device("cpu"))
    embedding.install()
    moved = BATCH.to("cpu")
    assert moved.host_input_ids is BATCH.input_ids
    staged = moved.host_input_ids.clone()
    embedding.stage(staged)
    seen: list[torch.Tensor] = []
    table = hf(model).get_input_embeddings()
    table.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    table(moved.input_ids)
    assert seen[0] is staged
    table(moved.input_ids)  # used once: a later call without staging copies as before
    assert seen[1] is not staged and torch.equal(seen[1], staged)
    embedding.remove()


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


def test_a_direct_lookup_gives_the_modules_rows_from_the_staged_ids() -> None:
    """The step-graph path gathers straight into the (pinned, on a GPU) upload buffer: the same rows as the module,
    from the staged host ids; a subclass that changes its rows goes through its own forward."""
    model = tiny_lora_model("llama", seed=3)
    embedding = HostEmbedding(hf(model), torch.device("cpu"))
    table = hf(model).get_input_embeddings()
    ids = BATCH.input_ids
    expected = table(ids)
    assert torch.equal(embedding.lookup(ids), expected)  # not installed: the module itself
    embedding.install()
    staged = ids.clone()
    embedding.stage(staged)
    seen: list[torch.Tensor] = []
    table.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    first = embedding.lookup(ids)
    assert torch.equal(first, expected) and not seen  # gathered directly, not through the module
    assert embedding._staged is None  # the staged ids were used up
    second = embedding.lookup(ids[:, :5])
    assert torch.equal(second, expected[:, :5]) and torch.equal(first, expected)  # buffers alternate
    table.__class__ = ScaledEmbedding
    assert torch.equal(embedding.lookup(ids), 2 * expected) and seen
    embedding.remove()


class ScaledEmbedding(torch.nn.Embedding):
    """Rows scaled in forward, as some model families do."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(ids)
