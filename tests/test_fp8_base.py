"""fp8 base matmuls: frozen-weight products in e4m3 follow the 16-bit path within fp8 rounding, in every mode.

torch multiplies fp8 on the CPU too (emulated, slower), so these run the real products there, with the switch's
refusal on the CPU lifted; the GPU test in test_speed_gpu.py checks the tensor-core path.
"""

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
from engine.speed import SpeedController, fp8_base
from engine.speed.fp8_base import E4M3_MAX, Fp8Projection, quantize_rows, weight_columns
from engine.speed.lean_recompute import FrozenProjection

CPU = torch.device("cpu")
UNAVAILABLE = fp8_base.unavailable_reason
PLAIN = SpeedConfig(
    metadata_cache=True, checkpointing="none", dequant_once=False, fp8_base="off"
)  # the 16-bit references: fp8 is automatic for a 4-bit base under offloaded checkpointing
OFFLOADED = dataclasses.replace(PLAIN, checkpointing="offloaded")
FP8_ERROR = 0.25
"""Bound on each parameter gradient's relative error (norm of the difference over the norm) in a tiny model with
fp8 products: about 4% per product, compounding through two layers."""


@pytest.fixture(autouse=True)
def fp8_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product refuses fp8 on the CPU (it would only be emulated); these tests emulate it on purpose."""
    monkeypatch.setattr(
        fp8_base, "unavailable_reason", lambda device: None if device.type == "cpu" else UNAVAILABLE(device)
    )


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def worst_gradient_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(relative(a[name], b[name]) for name in b)


def run(model: Any, settings: SpeedConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor], SpeedController]:
    batch = packed_batch((40, 30, 20))
    controller = SpeedController(model, settings, CPU)
    loss, _ = step(model, controller.model_inputs(batch), batch)
    return loss, grads(model), controller


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-fp8")
    build_model(folder, VOCAB)
    return folder


def test_rows_quantize_to_e4m3_with_one_scale_each() -> None:
    t = torch.randn(8, 64) * torch.logspace(-6, 3, 8).unsqueeze(1)  # rows nine orders of magnitude apart
    t[3] = 0.0
    q, scale = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    back = q.float() * scale
    assert torch.all(q.float().abs().amax(dim=1)[torch.arange(8) != 3] == E4M3_MAX)
    assert torch.equal(back[3], torch.zeros(64))  # an all-zero row stays zero, not NaN
    for row in (0, 4, 7):
        assert relative(back[row], t[row]) < 0.05  # 3 mantissa bits, whatever the row's magnitude


def test_projection_and_input_gradient_follow_float32_within_fp8_rounding() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 50, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(96, 64, dtype=torch.bfloat16) * 0.05
    bias = torch.randn(96, dtype=torch.bfloat16)
    out = Fp8Projection.apply(x, weight, None, bias, *weight_columns(weight), False, False)
    reference = x.float() @ weight.float().t() + bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (3, 50, 96)
    assert 0.005 < relative(out, reference) < 0.06  # fp8's rounding, not bf16's (0.2%) and not a wrong product
    grad = torch.randn_like(out)
    out.backward(grad)
    assert 0.005 < relative(x.grad, grad.float() @ weight.float()) < 0.06


def test_kept_weight_gives_the_gradient_of_dequantizing_again() -> None:
    """``keep`` (inside a recompute with dequantize-once) only saves work: the same fp8 weight either way."""
    torch.manual_seed(1)
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    columns = weight_columns(weight)
    grads_of = []
    for keep in (False, True):
        x = torch.randn(20, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2)).requires_grad_()
        Fp8Projection.apply(x, weight, None, None, *columns, keep, False).sum().backward()
        grads_of.append(x.grad)
    assert torch.equal(*grads_of)


def test_unread_output_multiplies_nothing_but_still_gives_its_gradient() -> None:
    torch.manual_seed(3)
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    x = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    columns = weight_columns(weight)
    out = Fp8Projection.apply(x, weight, None, None, *columns, False, True)
    assert out.shape == (20, 48)
    grad = torch.randn(20, 48, dtype=torch.bfloat16)
    out.backward(grad)
    read = x.detach().clone().requires_grad_()
    Fp8Projection.apply(read, weight, None, None, *columns, False, False).backward(grad)
    assert torch.equal(x.grad, read.grad)


@pytest.mark.parametrize("checkpointing", ["none", "offloaded"])
def test_bf16_lora_model_trains_with_fp8_products(checkpointing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = mixed_precision_lora_model("llama")
    settings = dataclasses.replace(PLAIN, checkpointing=checkpointing)
    loss_ref, grads_ref, _ = run(model, settings)
    scaled_mm = _count_scaled_mm(monkeypatch)
    loss, grads_fp8, controller = run(model, dataclasses.replace(settings, fp8_base="all"))
    state = controller.state()["fp8_base"]
    assert state["on"] and "e4m3" in state["reason"]
    layers = model.base_model.model.config.num_hidden_layers
    # every frozen projection forward, and its input gradient except where nothing below needs one
    assert scaled_mm[0] >= 7 * (2 * layers - 1)
    assert torch.isfinite(loss) and abs(float(loss - loss_ref)) / float(loss_ref) < 0.02
    assert not torch.equal(loss, loss_ref)  # the products did change precision
    assert worst_gradient_error(grads_fp8, grads_ref) < FP8_ERROR


def test_qlora_fp8_with_lean_recompute_and_dequantize_once(tiny_dir: Path) -> None:
    model = tiny_qlora_model(tiny_dir)
    lean = dataclasses.replace(OFFLOADED, dequant_once=True)
    loss_ref, grads_ref, _ = run(model, lean)
    loss, grads_fp8, controller = run(model, dataclasses.replace(lean, fp8_base="all"))
    state = controller.state()
    assert state["fp8_base"]["on"] and state["dequant_once"]["on"]
    assert any(wrapper.skip_unread and wrapper.output_unread for _, _, wrapper in controller.lean.installed)
    assert abs(float(loss - loss_ref)) / float(loss_ref) < 0.02
    assert worst_gradient_error(grads_fp8, grads_ref) < FP8_ERROR
    controller.apply(lean)  # off again: the 16-bit products, bit for bit
    loss_back, grads_back, _ = run(model, lean)
    assert torch.equal(loss_back, loss_ref)
    assert all(torch.equal(grads_back[name], grads_ref[name]) for name in grads_ref)


def test_fp8_in_the_recompute_keeps_the_16bit_loss_asked_for_or_automatic(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fp8_base="recompute"``: the loss is the 16-bit path's bit for bit, the gradients carry fp8 rounding from
    the recompute and the input gradients (fewer products than fp8 everywhere, ``all``). Left automatic, a 4-bit
    base under offloaded checkpointing runs the same products."""
    model = tiny_qlora_model(tiny_dir)
    lean = dataclasses.replace(OFFLOADED, dequant_once=True)
    loss_ref, grads_ref, _ = run(model, lean)
    scaled_mm = _count_scaled_mm(monkeypatch)
    loss, grads_fp8, controller = run(model, dataclasses.replace(lean, fp8_base="recompute"))
    state = controller.state()["fp8_base"]
    assert state["on"] and "loss stay 16-bit" in state["reason"]
    assert scaled_mm[0] > 0 and torch.equal(loss, loss_ref)
    assert 0 < worst_gradient_error(grads_fp8, grads_ref) < FP8_ERROR
    products_in_recompute = scaled_mm[0]
    loss, grads_auto, controller = run(model, dataclasses.replace(lean, fp8_base="auto"))
    state = controller.state()["fp8_base"]
    assert state["on"] and state["reason"].startswith("automatic:") and "loss stay 16-bit" in state["reason"]
    assert scaled_mm[0] == 2 * products_in_recompute and torch.equal(loss, loss_ref)
    assert all(torch.equal(grads_auto[name], grads_fp8[name]) for name in grads_fp8)
    run(model, dataclasses.replace(lean, fp8_base="all"))
    assert scaled_mm[0] - 2 * products_in_recompute > products_in_recompute  # fp8 everywhere adds the forward's


@pytest.mark.parametrize("checkpointing", ["none", "standard"])
def test_automatic_fp8_leaves_a_qlora_run_without_offloaded_recompute_in_16_bits(
    tiny_dir: Path, checkpointing: str
) -> None:
    model = tiny_qlora_model(tiny_dir)
    settings = dataclasses.replace(PLAIN, checkpointing=checkpointing)
    loss_ref, grads_ref, _ = run(model, settings)
    loss, grads_auto, controller = run(model, dataclasses.replace(settings, fp8_base="auto"))
    state = controller.state()["fp8_base"]
    assert not state["on"] and "offloaded checkpointing" in state["reason"]
    assert torch.equal(loss, loss_ref) and all(torch.equal(grads_auto[k], grads_ref[k]) for k in grads_ref)


def test_automatic_fp8_leaves_a_16bit_base_in_16_bits() -> None:
    model = mixed_precision_lora_model("llama")
    _, _, controller = run(model, dataclasses.replace(OFFLOADED, fp8_base="auto"))
    state = controller.state()["fp8_base"]
    assert not state["on"] and "4-bit (QLoRA) base" in state["reason"]


def test_fp8_in_the_recompute_only_needs_offloaded_checkpointing() -> None:
    model = mixed_precision_lora_model("llama")
    loss_ref, grads_ref, _ = run(model, PLAIN)
    loss, grads, controller = run(model, dataclasses.replace(PLAIN, fp8_base="recompute"))
    state = controller.state()["fp8_base"]
    assert not state["on"] and "offloaded checkpointing" in state["reason"]
    assert torch.equal(loss, loss_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)


def test_a_wrong_weight_scale_is_caught() -> None:
    """The comparison above can fail: output columns scaled by twice the weight's scale in the product (all but the
    first, whose scale also quantizes the weight) double most of every frozen projection's output."""
    model = mixed_precision_lora_model("llama")
    _, grads_ref, _ = run(model, PLAIN)
    _, _, controller = run(model, dataclasses.replace(PLAIN, fp8_base="all"))
    for _, _, wrapper in controller.lean.installed:
        wrapper.fp8_columns[0][:, 1:].mul_(2.0)
    _, grads_wrong, _ = run(model, dataclasses.replace(PLAIN, fp8_base="all"))
    assert not worst_gradient_error(grads_wrong, grads_ref) < FP8_ERROR


def test_switching_off_puts_the_library_modules_back() -> None:
    model = mixed_precision_lora_model("llama")
    names = [name for name, _ in model.named_parameters()]
    saved = list(model.state_dict())
    _, _, controller = run(model, dataclasses.replace(PLAIN, fp8_base="all"))
    assert any(isinstance(m, FrozenProjection) for m in model.modules())
    assert [name for name, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == saved  # the weight scales are never saved
    controller.apply(PLAIN)
    assert not any(isinstance(m, FrozenProjection) for m in model.modules())
    assert not controller.state()["fp8_base"]["on"]


def test_widths_that_are_not_multiples_of_16_keep_the_16_bit_path() -> None:
    model = mixed_precision_lora_model("llama", intermediate_size=120)
    _, _, controller = run(model, dataclasses.replace(PLAIN, fp8_base="all"))
    done, one_pass, total = controller.lean.fp8_projections()
    assert one_pass == 0  # the one-pass kernel runs on NVIDIA GPUs only
    layers = model.base_model.model.config.num_hidden_layers
    assert total - done == 3 * layers  # gate, up and down projections are 120 wide
    assert "not multiples of 16" in controller.state()["fp8_base"]["reason"]


def test_compiled_regions_take_the_fp8_products_without_graph_breaks(tiny_dir: Path) -> None:
    """Compiled per child, 4-bit, under offloaded checkpointing (whose recompute skips unread outputs)."""
    from torch._dynamo.utils import counters

    model = tiny_qlora_model(tiny_dir)
    settings = dataclasses.replace(OFFLOADED, dequant_once=True, fp8_base="all")
    _, grads_eager, _ = run(model, settings)
    torch._dynamo.reset()
    counters.clear()
    controller = SpeedController(model, settings, CPU)
    controller.region_compiler.backend = "aot_eager"
    controller.apply(dataclasses.replace(settings, fused_kernels=True))
    batch = packed_batch((40, 30, 20))
    step(model, controller.model_inputs(batch), batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert max_relative_error(grads(model), grads_eager) <= 1e-2
    controller.apply(settings)
    torch._dynamo.reset()


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] | None) -> None:
    """A CUDA device of this compute capability, whose torch multiplies fp8 with per-row scales."""
    monkeypatch.setattr(fp8_base, "unavailable_reason", UNAVAILABLE)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: capability)
    monkeypatch.setattr(fp8_base, "_probe", lambda _device: None)
    monkeypatch.setattr(fp8_base, "_PROBED", {})


@pytest.mark.parametrize(
    ("capability", "checkpointing", "four_bit", "experts", "on"),
    [
        ((8, 9), "offloaded", True, False, True),  # RTX 40 series
        ((9, 0), "offloaded", True, False, True),  # Hopper
        ((10, 0), "offloaded", True, False, True),  # Blackwell data centre
        ((12, 0), "offloaded", True, False, True),  # RTX 50 series
        ((12, 1), "offloaded", True, False, True),  # GB10 (DGX Spark)
        ((8, 6), "offloaded", True, False, False),  # RTX 30 series: no fp8 tensor cores
        ((9, 0), "standard", True, False, False),  # torch's checkpoint: no recompute of ours to scope
        ((9, 0), "none", True, False, False),
        ((9, 0), "offloaded", False, False, False),  # a 16-bit base: not measured within bf16 noise
        ((9, 0), "offloaded", True, True, False),  # a MoE model: its speed with fp8 not measured
    ],
)
def test_automatic_resolution_by_gpu_and_run(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    checkpointing: str,
    four_bit: bool,
    experts: bool,
    on: bool,
) -> None:
    """Automatic fp8 is for QLoRA's offloaded recompute on GPUs with fp8 tensor cores, always in that scope."""
    fake_gpu(monkeypatch, capability)
    got, reason = fp8_base.resolve("auto", torch.device("cuda"), 14, checkpointing, four_bit, experts)
    assert got is on and ("e4m3" in reason) is on
    assert reason.startswith("automatic:") or f"sm{capability[0]}{capability[1]}" in reason
    assert fp8_base.scope_of("auto") == fp8_base.scope_of("recompute") == "recompute"
    assert fp8_base.scope_of("all") == "all"


@pytest.mark.parametrize(
    ("requested", "device", "capability", "on", "words"),
    [
        ("auto", "cuda", (9, 0), False, "automatic: off"),
        ("off", "cuda", (9, 0), False, "switched off"),
        ("recompute", "cuda", (8, 6), False, "sm86"),
        ("auto", "cuda", (8, 6), False, "sm86"),
        ("all", "cuda", (7, 5), False, "sm75"),
        ("all", "cuda", (8, 9), True, "fp8 tensor cores"),
        ("all", "cuda", (12, 1), True, "fp8 tensor cores"),
        ("all", "mps", None, False, "NVIDIA"),
        ("all", "cpu", None, False, "only emulate"),
    ],
)
def test_resolution_by_gpu(
    monkeypatch: pytest.MonkeyPatch,
    requested: str,
    device: str,
    capability: tuple[int, int] | None,
    on: bool,
    words: str,
) -> None:
    """RTX 30 (sm86) and older have no fp8 tensor cores; RTX 40 (sm89), Hopper, Blackwell and GB10 do."""
    fake_gpu(monkeypatch, capability)
    got, reason = fp8_base.resolve(requested, torch.device(device), frozen=14)
    assert got is on and words in reason


def test_a_torch_without_row_scaled_fp8_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", _raise_not_supported, raising=False)
    problem = fp8_base._probe(CPU)  # the probe's tiny product fails the same way on any device
    assert problem is not None and "not supported" in problem
    monkeypatch.setattr(fp8_base, "unavailable_reason", UNAVAILABLE)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: (9, 0))
    monkeypatch.setattr(fp8_base, "_PROBED", {"cuda": problem})
    on, reason = fp8_base.resolve("all", torch.device("cuda"), frozen=14)
    assert not on and "cannot multiply fp8" in reason and "not supported" in reason


def _raise_not_supported(*_: Any, **__: Any) -> torch.Tensor:
    raise RuntimeError("row-wise scaling not supported on this device")


def _count_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = torch._scaled_mm

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def test_moe_routers_and_experts_keep_their_precision() -> None:
    """fp8 acts on linear projections only: a MoE layer's router (its own module) keeps choosing experts from
    16-bit logits, and the 3-D experts keep their path."""
    model = mixed_precision_lora_model("qwen3_moe")
    _, _, controller = run(model, dataclasses.replace(PLAIN, fp8_base="all"))
    wrapped = {name for name, module in model.named_modules() if isinstance(module, FrozenProjection)}
    assert wrapped and all(".self_attn." in name for name in wrapped)
    assert controller.state()["fp8_base"]["on"]


def test_automatic_fp8_with_chunked_mlps_keeps_the_16bit_loss(tiny_dir: Path) -> None:
    """Rows too long for a small card run their MLPs in chunks: automatic fp8 there still leaves the forward pass,
    and so the loss, in 16 bits, with fp8 rounding only in the gradients."""
    model = tiny_qlora_model(tiny_dir)
    batch = packed_batch((40, 30, 20))
    chunked = dataclasses.replace(OFFLOADED, dequant_once=True, chunked_mlp=True)
    controller = SpeedController(model, dataclasses.replace(chunked, fp8_base="off"), CPU)
    results = {}
    for fp8 in ("off", "auto"):
        controller.apply(dataclasses.replace(chunked, fp8_base=fp8))
        controller.chunked.install(16)  # chunks of 16 of the batch's 90 tokens
        state = controller.state()
        assert state["chunked_mlp"]["on"] and state["fp8_base"]["on"] is (fp8 == "auto"), state["fp8_base"]
        loss, _ = step(model, controller.model_inputs(batch), batch)
        results[fp8] = loss, grads(model)
    (loss_ref, grads_ref), (loss, grads_auto) = results["off"], results["auto"]
    assert torch.equal(loss, loss_ref) and 0 < worst_gradient_error(grads_auto, grads_ref) < FP8_ERROR
