"""MoE routing: argsort + bincount and the sync-free variant equal the eager expert loop, LoRA on experts too."""

from __future__ import annotations

import pytest
import torch
from speed_models import grads, max_relative_error, packed_batch, step, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController, moe_routing


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_routing_modes_match_eager_loop(model_type: str) -> None:
    model = tiny_lora_model(model_type, experts=True)
    batch = packed_batch((13, 21, 6))
    hf = model.get_base_model()
    ctl = SpeedController(model, SpeedConfig(moe_routing="stock"), torch.device("cpu"))
    hf.set_experts_implementation("eager")  # the reference: transformers' per-expert loop
    inputs = ctl.model_inputs(batch)
    ref_loss, ref_logits = step(model, inputs, batch)
    ref_grads = grads(model)
    assert any("experts" in name and "lora" in name for name in ref_grads)
    for mode in ("bincount", "sync-free"):
        ctl.apply(SpeedConfig(moe_routing=mode))
        assert ctl.state()["moe_routing"]["mode"] == mode
        loss, logits = step(model, ctl.model_inputs(batch), batch)
        assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert torch.allclose(loss, ref_loss, atol=1e-6)
        assert max_relative_error(grads(model), ref_grads) <= 1e-5


def test_routing_core_counts_agree() -> None:
    top_k = torch.randint(0, 6, (50, 2))
    top_k[:, 1] = (top_k[:, 0] + 1) % 6
    host = moe_routing.route_tokens_by_expert(top_k, 7, host_counts=True)
    device = moe_routing.route_tokens_by_expert(top_k, 7, host_counts=False)
    assert torch.equal(host.order, device.order)
    assert device.offsets is not None and host.sizes is not None
    assert device.offsets.tolist() == torch.tensor(host.sizes).cumsum(0).tolist()
    assert host.sizes[6] == 0
    assert torch.equal(top_k.reshape(-1)[host.order], top_k.reshape(-1).sort(stable=True).values)


def test_grouped_mm_path_matches_loop_in_bf16() -> None:
    """On CPU grouped_mm runs in bf16: the sync-free kernel path against the per-expert loop."""
    torch.manual_seed(0)
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    weight = torch.randn(5, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    top_k = torch.randint(0, 5, (40, 1))
    routing = moe_routing.route_tokens_by_expert(top_k, 5, host_counts=False)
    xs = x[routing.token_index]
    fast = moe_routing.grouped_linear(xs, weight, routing, None, None, transposed=False)
    loop = moe_routing._looped_linear(
        xs, weight.transpose(-2, -1), None, moe_routing._sizes_from_offsets(routing.offsets)
    )
    assert torch.allclose(fast.float(), loop.float(), atol=1e-2, rtol=1e-2)


def test_auto_routing_resolution() -> None:
    dense = tiny_lora_model("llama")
    ctl = SpeedController(dense, SpeedConfig(), torch.device("cpu"))
    assert ctl.state()["moe_routing"]["mode"] == "stock"
    moe = tiny_lora_model("qwen3_moe")
    ctl = SpeedController(moe, SpeedConfig(), torch.device("cpu"))
    assert ctl.state()["moe_routing"]["mode"] == "bincount"
    assert moe.get_base_model().config._experts_implementation == moe_routing.BINCOUNT_NAME
    ctl.apply(SpeedConfig(moe_routing="stock"))
    assert moe.get_base_model().config._experts_implementation == "grouped_mm"


def test_sync_free_kernel_path_matches_eager_in_bf16() -> None:
    """bf16 takes grouped_mm (one kernel, offsets on the device); it agrees with the eager loop to bf16 noise."""
    model = tiny_lora_model("qwen3_moe", experts=True).to(torch.bfloat16)
    batch = packed_batch((13, 21, 6))
    ctl = SpeedController(model, SpeedConfig(moe_routing="sync-free"), torch.device("cpu"))
    inputs = ctl.model_inputs(batch)
    with torch.no_grad():
        fast = model(**inputs).logits.float()
        model.get_base_model().set_experts_implementation("eager")
        ref = model(**inputs).logits.float()
    assert float((fast - ref).abs().max() / ref.abs().max()) < 2e-2
