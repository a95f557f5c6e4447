"""One LoRA A product per group of projections reading the same input: the same outputs and gradients.

The groups are part of the 16-bit LoRA path (``lora_16bit``): its off switch is that setting's, and these tests
compare the grouped products with one product per adapter on the same 16-bit path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from speed_models import grads, max_relative_error, mixed_precision_lora_model, packed_batch, step, tiny_lora_model
from torch._dynamo.utils import counters

from engine.config import SpeedConfig
from engine.speed import SpeedController, lora_groups
from engine.speed.lora_16bit import Lora16Bit, adapted_layers

CPU = torch.device("cpu")
PLAIN = SpeedConfig(metadata_cache=True, checkpointing="none", fused_kernels=False, lora_16bit=False)
"""The controller leaves the adapters alone: each test installs the 16-bit path (in float32, so both sides are
exact) and the groups itself."""


def run(model: Any, lengths: tuple[int, ...] = (30, 18)) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = packed_batch(lengths)
    ctl_inputs = SpeedController(model, PLAIN, CPU).model_inputs(batch)
    _, logits = step(model, ctl_inputs, batch)
    return logits, grads(model)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_grouped_a_products_give_the_separate_outputs_and_gradients(model_type: str) -> None:
    """In float32 the stacked product differs from one product per adapter only in summation order; every A and B
    weight gets its gradient, and no group keeps a tensor after the step."""
    model = tiny_lora_model(model_type)
    Lora16Bit(model).install()  # the 16-bit adapter path, here in float32 so both sides are exact
    want_logits, want_grads = run(model)
    groups = lora_groups.LoraGroups()
    assert groups.install(model, adapted_layers(model)) == 2 * 2  # q/k/v and gate/up in each of two layers
    got_logits, got_grads = run(model)
    assert torch.allclose(got_logits, want_logits, atol=1e-5)
    assert max_relative_error(got_grads, want_grads) <= 1e-5
    assert sum("lora_A" in name for name in got_grads) == 2 * 7
    assert all(group.input is None and group.hidden is None for group in groups.groups)
    groups.remove()
    assert not any(hasattr(module, lora_groups.GROUP_ATTR) for module in model.modules())


def test_a_member_called_with_another_input_computes_its_own_product() -> None:
    model = tiny_lora_model("llama")
    Lora16Bit(model).install()
    attention = model.base_model.model.model.layers[0].self_attn
    x, other = torch.randn(1, 6, 64), torch.randn(1, 6, 64)
    want = [attention.q_proj(x), attention.k_proj(other), attention.v_proj(x)]
    groups = lora_groups.LoraGroups()
    groups.install(model, adapted_layers(model))
    got = [attention.q_proj(x), attention.k_proj(other), attention.v_proj(x)]
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # q and v shared one product for x; v, the last member, cleared it
    group, _ = getattr(attention.q_proj, lora_groups.GROUP_ATTR)
    assert group.input is None and group.hidden is None
    # called out of order, each member is still exact
    got = [attention.v_proj(x), attention.k_proj(other), attention.q_proj(x)]
    for a, b in zip(got, want[::-1], strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_groups_need_every_member_adapted_without_dropout() -> None:
    dropped = tiny_lora_model("llama", dropout=0.1)
    assert lora_groups.find_groups(dropped, adapted_layers(dropped)) == []
    model = tiny_lora_model("llama")
    assert len(lora_groups.find_groups(model, adapted_layers(model))) == 4
    layers = model.base_model.model.model.layers
    without_k = [(layer, name) for layer, name in adapted_layers(model) if layer is not layers[0].self_attn.k_proj]
    found = lora_groups.find_groups(model, iter(without_k))
    assert len(found) == 3  # layer 0 keeps its gate/up group only
    assert all(layers[0].self_attn.q_proj not in group.members for group in found)


def test_the_16bit_lora_path_groups_and_ungroups_with_its_switch() -> None:
    model = mixed_precision_lora_model("llama")
    settings = dataclasses.replace(PLAIN, lora_16bit=None)
    ctl = SpeedController(model, settings, CPU)
    state = ctl.state()["lora_16bit"]
    assert state["on"] and state["groups"] == 4, state
    assert state["reason"].endswith("; one A product for each of 4 groups of projections reading the same input")
    first = list(ctl.lora_groups.groups)
    ctl.apply(dataclasses.replace(settings, fused_loss=False))
    assert ctl.lora_groups.groups == first  # the same groups: compiled regions keep their graphs
    ctl.apply(dataclasses.replace(settings, lora_16bit=False))
    assert ctl.state()["lora_16bit"] == {
        "on": False,
        "reason": "switched off: peft's float32 adapter path (float32 copies of each adapted input)",
        "groups": 0,
    }
    assert not any(hasattr(module, lora_groups.GROUP_ATTR) for module in model.modules())
    ctl.apply(settings)
    assert ctl.state()["lora_16bit"]["groups"] == 4
    dropped = mixed_precision_lora_model("llama", dropout=0.1)  # no group can skip its members' dropout
    state = SpeedController(dropped, settings, CPU).state()["lora_16bit"]
    assert state["on"] and state["groups"] == 0, state


def test_compiled_regions_share_the_product_without_graph_breaks() -> None:
    """Compiled per child (q/k/v inside the attention region, gate/up inside the MLP's): Dynamo traces the group's
    state as a side effect and leaves it clear; the gradients are the eager ones."""
    model = tiny_lora_model("llama")
    Lora16Bit(model).install()
    groups = lora_groups.LoraGroups()
    assert groups.install(model, adapted_layers(model)) == 4
    settings = PLAIN
    batch = packed_batch((30, 18))
    eager = SpeedController(model, settings, CPU)
    step(model, eager.model_inputs(batch), batch)
    want = grads(model)
    torch._dynamo.reset()
    counters.clear()
    ctl = SpeedController(model, settings, CPU)
    ctl.region_compiler.backend = "aot_eager"
    ctl.apply(dataclasses.replace(settings, fused_kernels=True))
    try:
        step(model, ctl.model_inputs(batch), batch)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert max_relative_error(grads(model), want) <= 1e-5
        assert all(group.input is None for group in groups.groups)
    finally:
        ctl.apply(settings)
        torch._dynamo.reset()
