"""Lean recompute: skipped unread outputs and dequantize-once give the full recompute's gradients.

Skipping unread outputs is part of offloaded checkpointing (no setting of its own): the full recompute these tests
compare it with is the same controller with the stand-ins taken out (``lean.switch(False, False)``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_model
from speed_models import (
    VOCAB,
    grads,
    max_relative_error,
    mixed_precision_lora_model,
    packed_batch,
    step,
    tiny_qlora_model,
)

from engine.config import SpeedConfig
from engine.speed import SpeedController
from engine.speed.lean_recompute import (
    FrozenProjection,
    dequant_once_resolve,
    frozen_projections,
    layer_dequant_bytes,
)

OFF = SpeedConfig(metadata_cache=True, checkpointing="offloaded", dequant_once=False)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-lean")
    build_model(folder, VOCAB)
    return folder


def run(
    model: Any, settings: SpeedConfig, full_recompute: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor], SpeedController]:
    """One step; ``full_recompute``: the offloaded recompute runs every frozen projection (no stand-ins)."""
    batch = packed_batch((40, 30, 20))
    controller = SpeedController(model, settings, CPU)
    if full_recompute:
        controller.lean.switch(False, False)
    model.zero_grad(set_to_none=True)
    loss, _ = step(model, controller.model_inputs(batch), batch)
    return loss.detach(), grads(model), controller


def count_base_calls(model: Any, unread: bool) -> list[int]:
    """Counts calls of the frozen base modules whose outputs are (un)read in recompute."""
    calls = [0]
    for _, _, base, is_unread in frozen_projections(model):
        if is_unread == unread:
            base.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_skipped_down_projection_gives_the_full_recompute_gradients_exactly() -> None:
    model = mixed_precision_lora_model("llama")
    loss_full, grads_full, _ = run(model, OFF, full_recompute=True)
    calls = count_base_calls(model, unread=True)
    loss_lean, grads_lean, controller = run(model, OFF)
    assert controller.lean.installed and all(wrapper.skip_unread for _, _, wrapper in controller.lean.installed)
    assert torch.equal(loss_lean, loss_full)
    assert all(torch.equal(grads_lean[name], grads_full[name]) for name in grads_full)
    layers = model.base_model.model.config.num_hidden_layers
    assert calls[0] == layers  # forward only: never in the recompute (it would be 2 per layer)


def test_marking_a_read_output_unread_changes_the_gradients() -> None:
    """The check above can fail: skipping the output of a projection that the recompute reads (the up projection
    feeds the SwiGLU product) corrupts the gradients."""
    model = mixed_precision_lora_model("llama")
    _, grads_full, _ = run(model, OFF, full_recompute=True)
    _, _, controller = run(model, OFF)
    for layer in model.base_model.model.model.layers:
        up = layer.mlp.up_proj
        wrong = FrozenProjection(up.base_layer, controller.offloader.recompute, output_unread=True)
        wrong.skip_unread = True
        up._modules["base_layer"] = wrong
    model.zero_grad(set_to_none=True)
    batch = packed_batch((40, 30, 20))
    step(model, controller.model_inputs(batch), batch)
    error = max_relative_error(grads(model), grads_full)
    assert not error <= 1e-3  # uninitialised memory read: far off, or NaN


def test_only_the_mlp_down_projection_is_unread() -> None:
    model = mixed_precision_lora_model("llama")
    found = {(type(owner).__name__, name): unread for owner, name, _, unread in frozen_projections(model)}
    assert set(found.values()) == {True}  # bf16 base: only the unread one has anything to do
    assert all(owner == "Linear" and name == "base_layer" for owner, name in found)
    gemma = mixed_precision_lora_model("gemma3_text", head_dim=16)
    assert not list(frozen_projections(gemma))  # Gemma normalises the MLP's output: it is read


def test_qlora_dequantize_once_and_skip_match_the_library_path(tiny_dir: Path) -> None:
    model = tiny_qlora_model(tiny_dir)
    loss_full, grads_full, _ = run(model, OFF, full_recompute=True)
    assert layer_dequant_bytes(model) > 0
    on = dataclasses.replace(OFF, dequant_once=True)
    loss_lean, grads_lean, controller = run(model, on)
    assert controller.state()["dequant_once"]["on"]
    assert all(isinstance(w, FrozenProjection) for _, _, w in controller.lean.installed)
    assert torch.allclose(loss_lean, loss_full, rtol=1e-6)
    assert max_relative_error(grads_lean, grads_full) <= 1e-2  # the same bf16 matmuls, possibly other kernels
    controller.apply(dataclasses.replace(OFF, checkpointing="standard"))  # puts bitsandbytes' modules back
    assert not controller.lean.installed
    assert not any(isinstance(m, FrozenProjection) for m in model.modules())


def test_parameter_names_do_not_change_while_installed(tiny_dir: Path) -> None:
    model = tiny_qlora_model(tiny_dir)
    before = [name for name, _ in model.named_parameters()]
    controller = SpeedController(model, dataclasses.replace(OFF, dequant_once=True), CPU)
    assert controller.lean.installed
    assert [name for name, _ in model.named_parameters()] == before


def test_outside_the_recompute_the_library_path_runs() -> None:
    """Without checkpointing (or with torch's own) the stand-ins are never installed, or stay inactive."""
    model = mixed_precision_lora_model("llama")
    _, _, controller = run(model, dataclasses.replace(OFF, checkpointing="none"))
    assert not controller.lean.installed
    _, _, controller = run(model, dataclasses.replace(OFF, checkpointing="standard"))
    assert not controller.lean.installed


@pytest.mark.parametrize(
    ("requested", "extra", "free", "on"),
    [(None, 300 << 20, 8 << 30, True), (None, 300 << 20, 2 << 30, False), (True, 300 << 20, 1 << 30, True),
     (False, 300 << 20, 8 << 30, False), (None, 0, 8 << 30, False), (None, 300 << 20, None, True)],
)  # fmt: skip
def test_dequant_once_resolution(requested: bool | None, extra: int, free: int | None, on: bool) -> None:
    assert dequant_once_resolve(requested, "offloaded", extra, free)[0] is on


def test_compiled_regions_guard_on_the_recompute_flag_without_graph_breaks(tiny_dir: Path) -> None:
    """The flag is read inside compiled regions: flipping it must recompile (one graph per value), not break."""
    from torch._dynamo.utils import counters

    model = tiny_qlora_model(tiny_dir)
    settings = dataclasses.replace(OFF, dequant_once=True)
    _, grads_eager, _ = run(model, settings)
    torch._dynamo.reset()
    counters.clear()
    controller = SpeedController(model, settings, CPU)
    controller.region_compiler.backend = "aot_eager"
    controller.apply(dataclasses.replace(settings, fused_kernels=True))
    model.zero_grad(set_to_none=True)
    batch = packed_batch((40, 30, 20))
    step(model, controller.model_inputs(batch), batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert max_relative_error(grads(model), grads_eager) <= 1e-2
    controller.apply(settings)
    torch._dynamo.reset()
