"""The 16-bit LoRA path: same function as peft's float32 path within bf16 noise, no float32 input copies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from speed_models import grads, max_relative_error, mixed_precision_lora_model, packed_batch, tiny_lora_model

from engine.config import SpeedConfig
from engine.data.model_inputs import stock_model_inputs
from engine.speed import SpeedController
from engine.speed.lora_16bit import Lora16Bit, adapted_layers, lora_update, resolve

TOKENS = (5, 11, 8)


def mixed_precision_model(model_type: str = "llama", dtype: torch.dtype = torch.bfloat16, **kw: Any) -> torch.nn.Module:
    return mixed_precision_lora_model(model_type, dtype, **kw)


def loss_and_grads(model: torch.nn.Module, on: bool) -> tuple[float, dict[str, torch.Tensor]]:
    switch = Lora16Bit(model)
    switch.switch(on)
    batch = packed_batch(TOKENS)
    loss = model(**stock_model_inputs(model, batch), labels=batch.labels).loss
    loss.backward()
    switch.remove()
    return float(loss), {k: v.float() for k, v in grads(model).items()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_sixteen_bit_path_stays_within_the_float32_paths_own_rounding_noise(model_type: str) -> None:
    exact_loss, exact = loss_and_grads(tiny_lora_model(model_type), on=False)
    stock_loss, stock = loss_and_grads(mixed_precision_model(model_type), on=False)
    fast_loss, fast = loss_and_grads(mixed_precision_model(model_type), on=True)
    assert fast_loss != stock_loss  # the path really changed
    assert abs(fast_loss - exact_loss) <= 2 * abs(stock_loss - exact_loss) + 2e-3
    assert max_relative_error(fast, exact) <= max(2 * max_relative_error(stock, exact), 2e-2)


def test_adapter_weights_and_their_gradients_stay_float32() -> None:
    model = mixed_precision_model()
    _, got = loss_and_grads(model, on=True)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.dtype == torch.float32 and p.grad is not None for p in lora.values())
    assert all(p.grad.dtype == torch.float32 for p in lora.values())
    assert set(got) == {n for n in lora}


def saved_float32_elements(model: torch.nn.Module, on: bool) -> int:
    """Elements of float32 tensors autograd saves in one forward pass."""
    switch = Lora16Bit(model)
    switch.switch(on)
    batch = packed_batch(TOKENS)
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.float32 and tensor.numel() >= sum(TOKENS):
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**stock_model_inputs(model, batch), labels=batch.labels)
    switch.remove()
    return sum(saved)


def test_no_float32_copies_of_adapted_inputs_are_kept_for_backward() -> None:
    model = mixed_precision_model()
    config = model.base_model.model.config
    tokens, hidden = sum(TOKENS), config.hidden_size
    stock = saved_float32_elements(model, on=False)
    fast = saved_float32_elements(model, on=True)
    # peft's path keeps a float32 copy of the input of each of the 7 adapted projections per layer
    assert stock - fast >= config.num_hidden_layers * 6 * tokens * hidden
    assert fast < stock / 2


def test_lora_update_matches_a_float64_reference() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(8, 32, bias=True)
    x = torch.randn(50, 64)
    ref = (x.double() @ a.weight.double().T @ b.weight.double().T + b.bias.double()) * 0.5
    got = lora_update(x, a, b, 0.5)
    assert got.dtype == torch.float32
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    half = lora_update(x.bfloat16(), a, b, 0.5)
    assert half.dtype == torch.bfloat16
    assert float((half.double() - ref).norm() / ref.norm()) < 2e-2


def test_switching_off_restores_peft_exactly() -> None:
    model = mixed_precision_model()
    before, reference = loss_and_grads(model, on=False)
    model.zero_grad(set_to_none=True)
    switch = Lora16Bit(model)
    switch.install()
    layers = list(adapted_layers(model))
    assert layers and all(adapter in layer.lora_variant for layer, adapter in layers)
    assert not any(layer.cast_input_dtype_enabled for layer, _ in layers)
    switch.remove()
    assert all(not layer.lora_variant and layer.cast_input_dtype_enabled for layer, _ in layers)
    after, again = loss_and_grads(model, on=False)
    assert after == before
    assert max_relative_error(again, reference) == 0.0


def test_merging_with_the_switch_on_gives_the_plain_lora_weights() -> None:
    plain = mixed_precision_model(dtype=torch.float32).merge_and_unload()
    model = mixed_precision_model(dtype=torch.float32)
    Lora16Bit(model).install()
    merged = model.merge_and_unload()
    for (name, p), (_, q) in zip(plain.named_parameters(), merged.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_dropout_runs_on_the_sixteen_bit_path() -> None:
    model = mixed_precision_model(dropout=0.1)
    loss, got = loss_and_grads(model, on=True)
    assert torch.isfinite(torch.tensor(loss)) and got


def test_controller_resolves_automatic_and_explains_float32() -> None:
    fast = SpeedController(mixed_precision_model(), SpeedConfig(), torch.device("cpu"))
    assert fast.state()["lora_16bit"]["on"] and fast.state()["lora_16bit"]["reason"].startswith("automatic:")
    fast.apply(SpeedConfig(lora_16bit=False))
    assert not fast.state()["lora_16bit"]["on"] and not fast.lora_16bit.on
    fast.apply(SpeedConfig(lora_16bit=True))
    assert fast.lora_16bit.on
    exact = SpeedController(tiny_lora_model("llama"), SpeedConfig(lora_16bit=True), torch.device("cpu"))
    assert not exact.state()["lora_16bit"]["on"]
    assert "float32" in exact.state()["lora_16bit"]["reason"]
    on, reason = resolve(None, torch.nn.Linear(2, 2), torch.bfloat16)
    assert not on and "no plain LoRA adapters" in reason


def test_flipping_the_switch_between_steps_keeps_training() -> None:
    model = mixed_precision_model()
    ctl = SpeedController(model, SpeedConfig(), torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(6):
        ctl.apply(SpeedConfig(lora_16bit=step % 2 == 0))
        batch = packed_batch(TOKENS, seed=1)
        loss = ctl.loss(model, ctl.model_inputs(batch), batch.labels, batch.trained_tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_compiled_regions_trace_the_sixteen_bit_path_without_breaks_or_recompiles() -> None:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from engine.speed import fused_kernels

    torch._dynamo.reset()
    counters.clear()
    model = mixed_precision_model()
    settings = SpeedConfig(metadata_cache=True, checkpointing="offloaded", lora_16bit=True, fused_kernels=True)
    ctl = SpeedController(model, SpeedConfig(metadata_cache=True, fused_kernels=False), torch.device("cpu"))
    counter = CompileCounter()
    ctl.region_compiler = fused_kernels.RegionCompiler(backend=counter)
    ctl.apply(settings)
    frames = []
    for seed, lengths in enumerate([(9, 20, 5), (30, 4), (12, 12, 12, 7)]):
        batch = packed_batch(lengths, seed=seed)
        ctl.loss(model, ctl.model_inputs(batch), batch.labels, batch.trained_tokens).backward()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[-1] == frames[0], f"graphs per step: {frames}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch._dynamo.reset()
