"""Kept attention: layers keep what they save in host memory and only MLPs recompute; same gradients as the
whole-layer recompute."""

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
from engine.speed import SpeedController, kept_attention
from engine.speed.chunked_mlp import TokenChunked
from engine.speed.offloaded_checkpoint import ActivationOffloader, dense_span, fixed_storages

CPU = torch.device("cpu")
WHOLE_LAYERS = SpeedConfig(metadata_cache=True, checkpointing="offloaded", keep_attention=False)
KEPT = dataclasses.replace(WHOLE_LAYERS, keep_attention=True)


def run(model: Any, settings: SpeedConfig, controller: SpeedController | None = None) -> tuple[Any, ...]:
    batch = packed_batch((40, 30, 20))
    controller = controller or SpeedController(model, settings, CPU)
    controller.apply(settings)
    model.zero_grad(set_to_none=True)
    loss, _ = step(model, controller.model_inputs(batch), batch)
    return loss.detach(), grads(model), controller


def count_calls(modules: list[torch.nn.Module]) -> list[int]:
    calls = [0]
    for module in modules:
        module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_kept_attention_gives_the_whole_layer_recompute_gradients(model_type: str) -> None:
    model = mixed_precision_lora_model(model_type)
    loss_ref, grads_ref, _ = run(model, WHOLE_LAYERS)
    loss, grads_kept, controller = run(model, KEPT)
    assert controller.state()["keep_attention"]["on"]
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    assert max_relative_error(grads_kept, grads_ref) <= 1e-2  # bf16 base: same operations, other grouping
    assert controller.offloader.saved_host_bytes() > 0  # the layers' saved tensors went to host buffers


def test_only_the_mlps_recompute() -> None:
    """Whole-layer recompute runs every attention block twice; kept attention once, the MLPs still twice."""
    model = mixed_precision_lora_model("llama")
    layers = model.base_model.model.model.layers
    attention = count_calls([layer.self_attn for layer in layers])
    mlp = count_calls([layer.mlp for layer in layers])
    run(model, WHOLE_LAYERS)
    assert attention[0] == 2 * len(layers)
    attention[0] = mlp[0] = 0
    run(model, KEPT)
    assert attention[0] == len(layers)
    assert mlp[0] == 2 * len(layers)  # forward without gradients, then the recompute in backward


def test_corrupting_a_kept_tensor_changes_the_gradients() -> None:
    """The comparison above can fail: a saved tensor that comes back wrong from host memory shows up."""
    model = mixed_precision_lora_model("llama")
    _, grads_ref, controller = run(model, WHOLE_LAYERS)
    offloader = controller.offloader
    unpack = offloader._unpack

    def corrupted(entry: Any) -> torch.Tensor:
        tensor = unpack(entry)
        return tensor * 1.5 if not isinstance(entry, torch.Tensor) else tensor

    offloader._unpack = corrupted  # type: ignore[method-assign]
    _, grads_bad, _ = run(model, KEPT, controller)
    assert not max_relative_error(grads_bad, grads_ref) <= 1e-2


def test_switching_off_restores_whole_layer_recompute() -> None:
    model = mixed_precision_lora_model("llama")
    _, _, controller = run(model, KEPT)
    assert controller.chunked.units and all(w.unit for _, _, w in controller.chunked.installed)
    controller.apply(WHOLE_LAYERS)
    assert not controller.offloader.keeps_saved
    assert not any(isinstance(m, TokenChunked) for m in model.modules())
    assert controller.state()["keep_attention"]["on"] is False


def test_chunked_mlp_takes_over_the_units() -> None:
    model = mixed_precision_lora_model("llama")
    _, grads_ref, _ = run(model, WHOLE_LAYERS)
    _, grads_both, controller = run(model, dataclasses.replace(KEPT, chunked_mlp=True))
    assert controller.chunked.on and not controller.chunked.units
    assert max_relative_error(grads_both, grads_ref) <= 1e-2


def test_qlora_kept_attention_with_lean_recompute(tmp_path: Path) -> None:
    """4-bit layers: quantization states never move; dequantize-once and the skipped down projection still apply
    inside the MLP's recompute."""
    build_model(tmp_path, VOCAB)
    model = tiny_qlora_model(tmp_path)
    lean = dict(lean_recompute=True, dequant_once=True)
    loss_ref, grads_ref, _ = run(model, dataclasses.replace(WHOLE_LAYERS, **lean))
    loss, grads_kept, controller = run(model, dataclasses.replace(KEPT, **lean))
    state = controller.state()
    assert state["keep_attention"]["on"] and state["lean_recompute"]["on"]
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    assert max_relative_error(grads_kept, grads_ref) <= 1e-2
    fixed = fixed_storages(model)
    weights = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    assert weights and all(w.quant_state.absmax.untyped_storage().data_ptr() in fixed for w in weights)


def test_saved_tensors_come_back_with_their_strides() -> None:
    offloader = ActivationOffloader(CPU, min_saved_bytes=0)
    offloader.keep_saved(True)
    x = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(5, 4)

    def layer(h: torch.Tensor) -> torch.Tensor:
        t = (h @ weight.T).t()  # saved transposed: a permuted, still dense layout
        return (t.sin() * t).sum(0)

    offloader.checkpoint(layer, x).sum().backward()
    reference = x.detach().clone().requires_grad_()
    layer(reference).sum().backward()
    assert torch.allclose(x.grad, reference.grad)
    assert offloader.saved_host_bytes() > 0


def test_dense_span_only_for_gapless_layouts() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(dense_span(base), base.reshape(-1))
    assert dense_span(base.t()) is not None
    assert dense_span(base[:, :3]) is None  # a gap between rows
    assert dense_span(torch.zeros(3).expand(4, 3)) is None  # overlapping


def test_parameters_and_resident_tensors_stay_put() -> None:
    offloader = ActivationOffloader(CPU, min_saved_bytes=0)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    offloader.keep_saved(True, torch.nn.Linear(4, 4))
    table = torch.randn(8, 4)
    offloader.keep_resident(table)
    group_pack = offloader._pack.__get__(offloader)
    from engine.speed.offloaded_checkpoint import _Group

    group = _Group(0)
    assert group_pack(group, weight) is weight  # a Parameter
    assert group_pack(group, table) is table  # resident for the step
    plain = torch.randn(4, 4)
    assert group_pack(group, plain) is not plain and len(group.entries) == 1
    assert group_pack(group, plain) is group_pack(group, plain)  # one host copy per tensor


@pytest.mark.parametrize(
    ("requested", "mode", "device", "step", "pinned", "free", "on"),
    [
        (True, "offloaded", "cuda", 6 << 30, 60 << 30, 3 << 30, True),
        (True, "offloaded", "cuda", 6 << 30, 4 << 30, 3 << 30, False),  # pinned host memory too small
        (True, "offloaded", "cuda", 6 << 30, 60 << 30, 1 << 30, False),  # two layers crowd the GPU
        (True, "standard", "cuda", 6 << 30, 60 << 30, 3 << 30, False),
        (True, "none", "cuda", 6 << 30, 60 << 30, 3 << 30, False),
        (True, "offloaded", "cpu", 6 << 30, 0, None, True),
        (None, "offloaded", "cuda", 6 << 30, 60 << 30, 3 << 30, False),  # automatic: off (no faster on the H200)
        (False, "offloaded", "cuda", 6 << 30, 60 << 30, 3 << 30, False),
    ],
)
def test_resolution(
    requested: bool | None, mode: str, device: str, step: int, pinned: int, free: int | None, on: bool
) -> None:
    layer = step // 32
    got, reason = kept_attention.resolve(
        requested, mode, torch.device(device), step_bytes=step, layer_bytes=layer, pinned_left=pinned, free_bytes=free
    )
    assert got is on and reason


def test_layer_saved_bytes_follows_the_shape() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert kept_attention.layer_saved_bytes(config, 4096) == 4096 * (7 * 4096 + 2 * 1024) * 2


def test_compiled_layers_keep_their_saved_tensors_without_graph_breaks() -> None:
    """Compiled regions save through the same hooks: the gradients match and Dynamo does not break graphs."""
    from torch._dynamo.utils import counters

    model = mixed_precision_lora_model("llama")
    _, grads_ref, _ = run(model, WHOLE_LAYERS)
    torch._dynamo.reset()
    counters.clear()
    controller = SpeedController(model, KEPT, CPU)
    controller.region_compiler.backend = "aot_eager"
    try:
        _, grads_kept, _ = run(model, dataclasses.replace(KEPT, fused_kernels=True), controller)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert controller.offloader.saved_host_bytes() > 0
        assert max_relative_error(grads_kept, grads_ref) <= 1e-2
    finally:
        controller.apply(WHOLE_LAYERS)
        torch._dynamo.reset()


def test_a_share_of_the_layers_keeps_and_the_rest_recompute() -> None:
    model = mixed_precision_lora_model("llama", num_hidden_layers=4)
    layers = model.base_model.model.model.layers
    _, grads_ref, controller = run(model, WHOLE_LAYERS)
    attention = count_calls([layer.self_attn for layer in layers])
    controller.kept_share_override = 0.5
    _, grads_half, _ = run(model, KEPT, controller)
    assert controller.offloader.kept_share == 0.5
    assert attention[0] == len(layers) + len(layers) // 2  # the other half recomputes its attention
    assert max_relative_error(grads_half, grads_ref) <= 1e-2


def test_layers_kept_are_spread_evenly() -> None:
    from engine.speed.offloaded_checkpoint import keeps_layer

    pattern = "".join("x" if keeps_layer(i, 0.5) else "." for i in range(8))
    assert pattern == ".x.x.x.x"
    assert all(keeps_layer(i, 1.0) for i in range(32)) and not any(keeps_layer(i, 0.0) for i in range(32))
    assert sum(keeps_layer(i, 0.7) for i in range(32)) == 22


def test_share_follows_link_and_compute() -> None:
    """A fast GPU on a PCIe 5.0 link keeps some layers; a consumer card on PCIe 4.0 keeps them all."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336
    )
    saved = kept_attention.layer_saved_bytes(config, 4096)
    flops = kept_attention.layer_forward_flops(config, 4096)
    assert 1.9e12 < flops < 2.0e12
    lane = kept_attention.PCIE_LANE_BYTES_PER_S
    efficiency = kept_attention.COMPUTE_EFFICIENCY
    h200 = kept_attention.kept_share(saved, flops, 16 * lane[5] * 0.87, 989e12 * efficiency)
    rtx_4090 = kept_attention.kept_share(saved, flops, 16 * lane[4] * 0.87, 165e12 * efficiency)
    assert 0.3 < h200 < 1.0
    assert rtx_4090 == 1.0


def test_a_gpu_named_without_its_index_is_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda`` and ``cuda:N`` name the same GPU: saved tensors on it are parked (they were not, on the GPU)."""
    from types import SimpleNamespace

    from engine.speed.offloaded_checkpoint import ActivationOffloader

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    offloader = ActivationOffloader(torch.device("cuda"))

    def on(device: str) -> bool:
        return offloader._on_device(SimpleNamespace(device=torch.device(device)))  # type: ignore[arg-type]

    assert on("cuda:1") and not on("cuda:0") and not on("cpu")
    assert ActivationOffloader(torch.device("cuda", 0))._on_device(SimpleNamespace(device=torch.device("cuda:0")))  # type: ignore[arg-type]
