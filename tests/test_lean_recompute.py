"""Lean recompute: skipped unread outputs and dequantize-once give the full recompute's gradients."""

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
    four_bit_kernel_resolve,
    frozen_projections,
    layer_dequant_bytes,
    lean_recompute_resolve,
)

OFF = SpeedConfig(metadata_cache=True, checkpointing="offloaded", lean_recompute=False, dequant_once=False)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-lean")
    build_model(folder, VOCAB)
    return folder


def run(model: Any, settings: SpeedConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor], SpeedController]:
    batch = packed_batch((40, 30, 20))
    controller = SpeedController(model, settings, CPU)
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
    loss_full, grads_full, _ = run(model, OFF)
    calls = count_base_calls(model, unread=True)
    loss_lean, grads_lean, controller = run(model, dataclasses.replace(OFF, lean_recompute=True))
    assert controller.state()["lean_recompute"]["on"]
    assert torch.equal(loss_lean, loss_full)
    assert all(torch.equal(grads_lean[name], grads_full[name]) for name in grads_full)
    layers = model.base_model.model.config.num_hidden_layers
    assert calls[0] == layers  # forward only: never in the recompute (it would be 2 per layer)


def test_marking_a_read_output_unread_changes_the_gradients() -> None:
    """The check above can fail: skipping the output of a projection that the recompute reads (the up projection
    feeds the SwiGLU product) corrupts the gradients."""
    model = mixed_precision_lora_model("llama")
    _, grads_full, _ = run(model, OFF)
    _, _, controller = run(model, dataclasses.replace(OFF, lean_recompute=True))
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
    loss_full, grads_full, _ = run(model, OFF)
    assert layer_dequant_bytes(model) > 0
    on = dataclasses.replace(OFF, lean_recompute=True, dequant_once=True)
    loss_lean, grads_lean, controller = run(model, on)
    state = controller.state()
    assert state["lean_recompute"]["on"] and state["dequant_once"]["on"]
    assert all(isinstance(w, FrozenProjection) for _, _, w in controller.lean.installed)
    assert torch.allclose(loss_lean, loss_full, rtol=1e-6)
    assert max_relative_error(grads_lean, grads_full) <= 1e-2  # the same bf16 matmuls, possibly other kernels
    controller.apply(OFF)  # switching off puts bitsandbytes' modules back
    assert not controller.lean.installed
    assert not any(isinstance(m, FrozenProjection) for m in model.modules())


def test_parameter_names_do_not_change_while_installed(tiny_dir: Path) -> None:
    model = tiny_qlora_model(tiny_dir)
    before = [name for name, _ in model.named_parameters()]
    controller = SpeedController(model, dataclasses.replace(OFF, lean_recompute=True, dequant_once=True), CPU)
    assert controller.lean.installed
    assert [name for name, _ in model.named_parameters()] == before


def test_outside_the_recompute_the_library_path_runs() -> None:
    """Without checkpointing (or with torch's own) the stand-ins are never installed, or stay inactive."""
    model = mixed_precision_lora_model("llama")
    _, _, controller = run(model, dataclasses.replace(OFF, checkpointing="none", lean_recompute=None))
    assert not controller.state()["lean_recompute"]["on"] and not controller.lean.installed
    _, _, controller = run(model, dataclasses.replace(OFF, checkpointing="standard", lean_recompute=True))
    assert not controller.lean.installed


@pytest.mark.parametrize(
    ("requested", "checkpointing", "on"),
    [(None, "offloaded", True), (True, "offloaded", True), (False, "offloaded", False), (None, "standard", False),
     (None, "none", False)],
)  # fmt: skip
def test_lean_recompute_resolution(requested: bool | None, checkpointing: str, on: bool) -> None:
    assert lean_recompute_resolve(requested, checkpointing)[0] is on


@pytest.mark.parametrize(
    ("requested", "extra", "free", "on"),
    [(None, 300 << 20, 8 << 30, True), (None, 300 << 20, 2 << 30, False), (True, 300 << 20, 1 << 30, True),
     (False, 300 << 20, 8 << 30, False), (None, 0, 8 << 30, False), (None, 300 << 20, None, True)],
)  # fmt: skip
def test_dequant_once_resolution(requested: bool | None, extra: int, free: int | None, on: bool) -> None:
    assert dequant_once_resolve(requested, "offloaded", extra, free)[0] is on


@pytest.mark.parametrize(
    ("requested", "device", "covered", "on", "reason"),
    [(None, "cuda", True, True, "automatic: 14 of 14 4-bit weights decoded in one kernel"),
     (True, "cuda", True, True, "switched on; 14 of 14"),
     (False, "cuda", True, False, "switched off: bitsandbytes'"),
     (None, "cpu", True, False, "runs on NVIDIA GPUs"),
     (None, "cuda", False, False, "no 4-bit weight here has a format or shape"),
     (None, "cuda-unmeasured", True, False, "automatic: off; on only under offloaded checkpointing"),
     (True, "cuda-unmeasured", True, True, "switched on; 14 of 14")],
)  # fmt: skip
def test_four_bit_kernel_resolution(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, requested: bool | None, device: str, covered: bool, on: bool,
    reason: str,
) -> None:  # fmt: skip
    from engine.speed import four_bit_weights

    monkeypatch.setattr(four_bit_weights, "covers_16bit", lambda state: covered)
    measured = not device.endswith("-unmeasured")
    where = torch.device(device.removesuffix("-unmeasured"))
    got, why = four_bit_kernel_resolve(requested, where, tiny_qlora_model(tiny_dir), measured=measured)
    assert got is on and reason in why, why


def test_the_4bit_kernel_is_chosen_after_the_first_long_row_chunks_its_mlps(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Automatic checkpointing turns on with the first long row, and so do chunked MLPs: the 4-bit kernel, automatic
    only with whole-row MLPs, is decided after the chunks, not from the state before them."""
    from engine.hardware.planner import CHUNK_MIN_ROW_TOKENS
    from engine.speed import lean_recompute

    monkeypatch.setattr(
        lean_recompute, "four_bit_kernel_resolve", lambda requested, device, model, measured=True: (measured, "spy")
    )  # fmt: skip
    controller = SpeedController(tiny_qlora_model(tiny_dir), SpeedConfig(metadata_cache=True), CPU)
    monkeypatch.setattr(controller, "_resolve_checkpointing", lambda requested: ("offloaded", "a GPU short of memory"))
    assert not controller.state()["chunked_mlp"]["on"]
    controller.model_inputs(packed_batch((CHUNK_MIN_ROW_TOKENS + 8,)))
    state = controller.state()
    assert state["checkpointing"]["mode"] == "offloaded" and state["chunked_mlp"]["on"], state["chunked_mlp"]
    assert not state["four_bit_kernel"]["on"] and controller.lean.one_kernel_projections() == 0


def test_four_bit_kernel_needs_4bit_weights_and_is_off_on_the_cpu(tiny_dir: Path) -> None:
    assert four_bit_kernel_resolve(None, torch.device("cuda"), mixed_precision_lora_model("llama")) == (
        False, "no 4-bit projections"
    )  # fmt: skip
    _, _, controller = run(tiny_qlora_model(tiny_dir), SpeedConfig(metadata_cache=True))
    assert controller.state()["four_bit_kernel"]["on"] is False
    assert controller.lean.one_kernel_projections() == 0


def test_compiled_regions_guard_on_the_recompute_flag_without_graph_breaks(tiny_dir: Path) -> None:
    """The flag is read inside compiled regions: flipping it must recompile (one graph per value), not break."""
    from torch._dynamo.utils import counters

    model = tiny_qlora_model(tiny_dir)
    settings = dataclasses.replace(OFF, lean_recompute=True, dequant_once=True)
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
