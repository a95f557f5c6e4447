"""GPU checks of the speed switches: kernels against the reference, and zero syncs in a training step."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hang import HANG_S
from speed_models import grads, mixed_precision_lora_model, packed_batch, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController, metadata_cache, moe_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
CUDA = torch.device("cuda")
LENGTHS = (300, 45, 700, 129, 1, 200, 600)


def bf16_model(model_type: str, experts: bool = False, **overrides: object) -> torch.nn.Module:
    settings = dict(hidden_size=256, head_dim=64, intermediate_size=512)
    settings.update(overrides)
    return tiny_lora_model(model_type, experts=experts, **settings).to(CUDA, torch.bfloat16)


def run_step(model: torch.nn.Module, ctl: SpeedController, lengths: tuple[int, ...] = LENGTHS) -> torch.Tensor:
    host = packed_batch(lengths)
    batch = host.to(CUDA)
    model.zero_grad(set_to_none=True)
    out = model(**ctl.model_inputs(batch), labels=batch.labels, num_items_in_batch=host.trained_tokens)
    out.loss.backward()
    return out.logits.detach().float()


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise on any host sync in the block (CUDA's sync debug mode), after the work queued before it has run."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def within_bf16_noise(
    model: torch.nn.Module, stock: SpeedConfig, fast: SpeedConfig, lengths: tuple[int, ...] = LENGTHS
) -> SpeedController:
    """Both bf16 paths are compared with a float32 run of the stock path: the fast one may not be noisier."""
    model.float()
    ctl = SpeedController(model, stock, CUDA)
    ref_logits, ref_grads = run_step(model, ctl, lengths), grads(model)
    model.to(torch.bfloat16)
    stock_logits, stock_grads = run_step(model, ctl, lengths), grads(model)
    ctl.apply(fast)
    fast_logits, fast_grads = run_step(model, ctl, lengths), grads(model)
    errors = {
        "logits": (relative_error(stock_logits, ref_logits), relative_error(fast_logits, ref_logits)),
        "grads": (
            max(relative_error(stock_grads[k], ref_grads[k]) for k in ref_grads),
            max(relative_error(fast_grads[k], ref_grads[k]) for k in ref_grads),
        ),
    }
    for stock_error, fast_error in errors.values():
        assert fast_error <= 1.5 * stock_error + 1e-3, errors
    return ctl


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> bool:
    return relative_error(a, b) < tol


def grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 5e-2) -> bool:
    assert a.keys() == b.keys() and a
    return max(relative_error(a[k], b[k]) for k in a) < tol


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_packed_backends_match_stock_path(backend: str) -> None:
    model = bf16_model("qwen3")
    stock = SpeedConfig(metadata_cache=False, checkpointing="none")
    fast = SpeedConfig(metadata_cache=True, checkpointing="none", attention_backend=backend)
    within_bf16_noise(model, stock, fast)


def test_sliding_window_varlen_matches_mask() -> None:
    model = bf16_model("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    masked = SpeedConfig(metadata_cache=True, checkpointing="none", attention_backend="sdpa")
    varlen = SpeedConfig(metadata_cache=True, checkpointing="none", attention_backend="varlen")
    within_bf16_noise(model, masked, varlen)


def test_offloaded_gradients_equal_standard_on_gpu() -> None:
    model = bf16_model("llama")
    # every layer checkpoints: resident layers (automatic) would keep a tiny model's activations on the GPU and
    # neither path would recompute or send anything to the host
    standard = SpeedConfig(metadata_cache=True, checkpointing="standard", resident_layers=False)
    ctl = SpeedController(model, standard, CUDA)
    ctl.offloader.min_offload_bytes = 0
    torch.manual_seed(0)
    run_step(model, ctl)
    assert ctl.resident_layers == 0, ctl.state()["resident_layers"]
    ref = grads(model)
    ctl.apply(dataclasses.replace(standard, checkpointing="offloaded"))
    for _ in range(2):  # the second step reuses the pinned host buffers
        run_step(model, ctl)
    assert ctl.offloader.pinned_bytes > 0
    got = grads(model)
    assert all(torch.allclose(got[k], ref[k], rtol=1e-2, atol=1e-5) for k in ref)


def test_training_step_with_everything_on_makes_no_sync() -> None:
    model = bf16_model("qwen3_moe", experts=True, moe_intermediate_size=128)
    ctl = SpeedController(
        model, SpeedConfig(metadata_cache=True, checkpointing="offloaded", moe_routing="sync-free"), CUDA
    )
    ctl.offloader.min_offload_bytes = 0
    ctl.resident_override = 1  # one layer resident, one offloaded (all of a tiny model would fit in spare memory)
    state = ctl.state()
    assert state["metadata_cache"]["backend"] == "varlen" and state["moe_routing"]["mode"] == "sync-free"
    host = packed_batch(LENGTHS)
    batch, n = host.to(CUDA), host.trained_tokens
    for _ in range(2):  # warm-up allocates host buffers and streams; the second step is checked
        inputs = ctl.model_inputs(batch)
        with no_host_sync():
            out = model(**inputs, labels=batch.labels, num_items_in_batch=n)
            out.loss.backward()
        model.zero_grad(set_to_none=True)
    assert ctl.resident_layers == 1 and ctl.offloader.pinned_bytes > 0, ctl.state()["resident_layers"]


@pytest.mark.parametrize(("mode", "dtype"), [("sync-free", torch.bfloat16), ("bincount", torch.float16)])
def test_moe_routing_matches_eager_on_gpu(mode: str, dtype: torch.dtype) -> None:
    model = tiny_lora_model("qwen3_moe", experts=True, moe_intermediate_size=128).to(CUDA, dtype)
    ctl = SpeedController(model, SpeedConfig(metadata_cache=False, checkpointing="none", moe_routing="stock"), CUDA)
    model.get_base_model().set_experts_implementation("eager")
    ref_logits, ref_grads = run_step(model, ctl), grads(model)
    ctl.apply(SpeedConfig(metadata_cache=False, checkpointing="none", moe_routing=mode))
    assert model.get_base_model().config._experts_implementation == moe_routing.IMPLEMENTATION_NAMES[mode]
    assert close(run_step(model, ctl), ref_logits) and grads_close(grads(model), ref_grads)


def test_varlen_is_the_automatic_backend_here() -> None:
    choice = metadata_cache.choose_backend("auto", CUDA, torch.bfloat16)
    assert choice.name == "varlen", choice.reason


def mixed_precision_model(model_type: str) -> torch.nn.Module:
    return mixed_precision_lora_model(model_type, hidden_size=256, head_dim=64, intermediate_size=512).to(CUDA)


def test_lora_16bit_stays_within_the_float32_paths_bf16_noise_on_gpu() -> None:
    settings = SpeedConfig(metadata_cache=True, checkpointing="none", fused_loss=False, fused_kernels=False)
    exact = tiny_lora_model("qwen3", hidden_size=256, head_dim=64, intermediate_size=512).to(CUDA)
    ctl = SpeedController(exact, settings, CUDA)
    ref_logits, ref_grads = run_step(exact, ctl), grads(exact)
    results = {}
    for on in (False, True):
        model = mixed_precision_model("qwen3")
        ctl = SpeedController(model, dataclasses.replace(settings, lora_16bit=on), CUDA)
        assert ctl.state()["lora_16bit"]["on"] is on
        logits, got = run_step(model, ctl), grads(model)
        results[on] = (relative_error(logits, ref_logits), max(relative_error(got[k], ref_grads[k]) for k in ref_grads))
    for stock_error, fast_error in zip(results[False], results[True], strict=True):
        assert fast_error <= 1.5 * stock_error + 2e-3, results


def test_compiled_loss_kernel_matches_the_eager_reference_on_gpu() -> None:
    from engine.speed.fused_loss import IGNORE_INDEX, linear_cross_entropy_sum

    g = torch.Generator(device=CUDA).manual_seed(0)
    hidden = torch.randn(3000, 256, device=CUDA, generator=g).to(torch.bfloat16)
    weight = (torch.randn(50000, 256, device=CUDA, generator=g) * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, 50000, (3000,), device=CUDA, generator=g)
    labels[::7] = IGNORE_INDEX
    eager = linear_cross_entropy_sum(hidden, weight, labels, chunk_size=512)
    fast = linear_cross_entropy_sum(hidden, weight, labels, chunk_size=512, compiled=True)
    assert abs(float(fast[0]) - float(eager[0])) <= 1e-4 * abs(float(eager[0]))
    assert fast[1] is not None and eager[1] is not None and relative_error(fast[1], eager[1]) < 1e-2


def test_triton_loss_kernel_matches_the_reference_at_a_llama_vocabulary_on_gpu() -> None:
    from engine.speed import loss_kernel
    from engine.speed.fused_loss import IGNORE_INDEX, softmax_cross_entropy_grad

    assert loss_kernel.available(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(1)
    logits = (torch.randn(512, 128256, device=CUDA, generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 128256, (512,), device=CUDA, generator=g)
    labels[::7] = IGNORE_INDEX
    want_loss, want_grad = softmax_cross_entropy_grad(logits, labels, 0.5)
    got_loss, got_grad = loss_kernel.softmax_cross_entropy_grad(logits, labels, 0.5, ignore_index=IGNORE_INDEX)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert float((got_grad.float() - want_grad.float()).abs().max()) <= 1e-3
    assert torch.all(got_grad[::7] == 0)


@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 14336), (1024, 4096), (4096, 12288)])
@pytest.mark.parametrize("nested", [True, False])
def test_4bit_weights_reach_e4m3_in_one_pass_with_the_two_pass_bits_on_gpu(
    shape: tuple[int, int], nested: bool
) -> None:
    """Every layout the kernel writes, at Llama-3.1-8B and Qwen3-8B projection shapes, bit for bit but for the
    rare value that division and multiplication by the reciprocal round apart."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from engine.speed.four_bit_weights import covers, e4m3_from_4bit
    from engine.speed.fp8_base import quantize_weight, weight_scale

    g = torch.Generator(device=CUDA).manual_seed(shape[0])
    weight = (torch.randn(shape, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    packed, state = quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=nested)
    assert covers(state)
    dense = dequantize_4bit(packed, state).to(torch.bfloat16)
    scale = weight_scale(dense)
    want = quantize_weight(dense, scale)
    want_t = want.t().contiguous()
    for rows_out, transposed_out in ((True, False), (False, True), (True, True)):
        forward, backward = e4m3_from_4bit(packed, state, scale, torch.bfloat16, rows_out, transposed_out)
        for asked, got, reference in ((rows_out, forward, want), (transposed_out, backward, want_t)):
            if not asked:
                assert got is None
                continue
            assert got is not None and got.shape == reference.shape
            differ = (got.view(torch.uint8) != reference.view(torch.uint8)).float().mean().item()
            assert differ <= 1e-4, (rows_out, transposed_out, differ)


def tiny_4bit_model() -> torch.nn.Module:
    """A two-layer Llama in NF4 on the GPU with LoRA whose B factors are nonzero (every adapter gets a gradient)."""
    from speed_models import tiny_config

    from engine.bench.long_context import build_quantized_model, with_lora

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=512, head_dim=64, intermediate_size=1024)
    model = with_lora(build_quantized_model(config, CUDA), "tunedeck")
    model.train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_both_triton_kernels_run_on_their_tensors_gpu_while_another_is_current() -> None:
    """A run on ``cuda:1`` in a process whose current GPU is ``cuda:0`` (``--gpus 1`` style): the loss kernel and
    the 4-bit decode kernel (to e4m3) give what they give with ``cuda:1`` current."""
    from bitsandbytes.functional import quantize_4bit

    from engine.speed import loss_kernel
    from engine.speed.four_bit_weights import e4m3_from_4bit
    from engine.speed.fp8_base import weight_scale
    from engine.speed.fused_loss import IGNORE_INDEX

    second = torch.device("cuda", 1)
    g = torch.Generator(device=second).manual_seed(2)
    logits = (torch.randn(256, 32000, device=second, generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 32000, (256,), device=second, generator=g)
    weight = (torch.randn(1024, 4096, device=second, generator=g) * 0.02).to(torch.bfloat16)
    with torch.cuda.device(second):
        packed, state = quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
        scale = weight_scale(weight)

    def both() -> tuple[torch.Tensor, ...]:
        loss, grad = loss_kernel.softmax_cross_entropy_grad(logits, labels, 0.5, ignore_index=IGNORE_INDEX)
        rows, columns = e4m3_from_4bit(packed, state, scale, torch.bfloat16, True, True)
        assert rows is not None and columns is not None
        return loss, grad, rows.view(torch.uint8), columns.view(torch.uint8)

    with torch.cuda.device(second):
        want = both()
    with torch.cuda.device(0):
        got = both()
    torch.cuda.synchronize(second)
    for a, b in zip(got, want, strict=True):
        assert a.device == second and torch.equal(a, b)


@pytest.mark.parametrize("tokens", [4096, 1000])
def test_cudnn_attention_is_as_close_to_float32_as_flash_attention_on_gpu(tokens: int) -> None:
    """cuDNN's whole-row kernel and FlashAttention-2's varlen kernel, both fed grouped K/V (8 query, 2 K/V heads of
    128), against float32 causal attention: outputs and all three gradients, cuDNN no noisier. 1,000 tokens is no
    multiple of any tile."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, h, 128, device=CUDA, generator=g, requires_grad=True) for h in (8, 2, 2))
    grad_out = torch.randn(1, tokens, 8, 128, device=CUDA, generator=g)
    meta = metadata_cache.build_metadata(packed_batch((tokens,)), CUDA, "varlen")

    def run(kind: str) -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        if kind == "float32":
            qq, kk, vv = (t.transpose(1, 2) for t in (q, k, v))
            kk, vv = (t.repeat_interleave(4, dim=1) for t in (kk, vv))
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=128**-0.5)
            out = out.transpose(1, 2)
        else:
            qq, kk, vv = (t.to(torch.bfloat16) for t in (q, k, v))
            if kind == "cudnn":
                args = (t.transpose(1, 2) for t in (qq, kk, vv))
                out = metadata_cache.cudnn_causal_attention(*args, scale=128**-0.5).transpose(1, 2)
            else:
                out = metadata_cache.grouped_flash_attention(qq[0], kk[0], vv[0], meta, 128**-0.5, None)[None]
        out.backward(grad_out.to(out.dtype))
        return [out.detach().float(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    want = run("float32")
    flash, cudnn = run("flash"), run("cudnn")
    errors = [(relative_error(f, w), relative_error(c, w)) for f, c, w in zip(flash, cudnn, want, strict=True)]
    assert all(c <= 1.5 * f + 1e-3 for f, c in errors), errors


def test_cudnn_attention_trains_one_document_rows_within_bf16_noise_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = metadata_cache.cudnn_causal_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(metadata_cache, "cudnn_causal_attention", counted)
    model = bf16_model("llama", head_dim=64)
    stock = SpeedConfig(metadata_cache=False, checkpointing="none")
    fast = SpeedConfig(metadata_cache=True, checkpointing="none", attention_backend="cudnn")
    ctl = within_bf16_noise(model, stock, fast, lengths=(1000,))
    assert ctl.state()["cudnn_attention"]["on"] and calls


def test_lora_groups_train_within_bf16_noise_on_gpu() -> None:
    """One A product per q/k/v and gate/up group (the 16-bit LoRA path), compiled regions and all: no noisier than
    the stock path."""
    model = bf16_model("llama")
    stock = SpeedConfig(metadata_cache=False, checkpointing="none")
    fast = SpeedConfig(metadata_cache=True, checkpointing="none", lora_16bit=True)
    ctl = within_bf16_noise(model, stock, fast)
    assert ctl.state()["lora_16bit"]["groups"] > 0, ctl.state()["lora_16bit"]


@pytest.mark.parametrize("window", [None, 96])
def test_grouped_flash_attention_matches_repeated_kv_on_gpu(window: int | None) -> None:
    """The kernel fed grouped K/V equals the same kernel fed K/V repeated to every query head, gradients too."""
    meta = metadata_cache.build_metadata(packed_batch(LENGTHS), CUDA, "varlen")
    g = torch.Generator(device=CUDA).manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, 8, 64, device=CUDA, generator=g, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(total, 2, 64, device=CUDA, generator=g, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
    )
    grad_out = torch.randn(total, 8, 64, device=CUDA, generator=g, dtype=torch.bfloat16)
    results = []
    for repeat in (True, False):
        q.grad = k.grad = v.grad = None
        kk, vv = (t.repeat_interleave(4, dim=1) if repeat else t for t in (k, v))
        out = metadata_cache.grouped_flash_attention(q, kk, vv, meta, 0.125, window)
        out.backward(grad_out)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for repeated, grouped in zip(*results, strict=True):
        assert relative_error(grouped, repeated) < 1e-2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 tensor cores"
)
@pytest.mark.parametrize("checkpointing", ["none", "offloaded"])
def test_fp8_base_products_on_tensor_cores_follow_bf16_with_no_sync(checkpointing: str) -> None:
    """fp8 products with the frozen weights (per-row scales, cuBLAS fp8 kernels) stay within fp8 rounding of the
    bf16 path, in plain training and in offloaded checkpointing's recompute, without a host sync."""
    model = bf16_model("llama")
    # every layer recomputes under offloaded checkpointing (resident layers, automatic, would keep a tiny model's)
    base = SpeedConfig(metadata_cache=True, checkpointing=checkpointing, resident_layers=False)
    ctl = SpeedController(model, base, CUDA)
    ctl.offloader.min_offload_bytes = 0
    ref_logits = run_step(model, ctl)
    ref = grads(model)
    ctl.apply(dataclasses.replace(base, fp8_base="all"))
    assert ctl.state()["fp8_base"]["on"], ctl.state()["fp8_base"]
    run_step(model, ctl)
    with no_host_sync():
        logits = run_step(model, ctl)
    got = grads(model)
    errors = relative_error(logits, ref_logits), max(relative_error(got[k], ref[k]) for k in ref)
    assert 1e-3 < errors[0] < 0.15 and errors[1] < 0.3, errors  # measured on the H200: 0.072 and 0.157


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 tensor cores"
)
def test_fp8_weights_from_4bit_codes_in_one_pass_train_as_the_two_pass_weights_on_gpu() -> None:
    """A 4-bit model under offloaded checkpointing (forward, recompute with kept weights, backward): the same
    losses and gradients whether each fp8 weight comes from its codes in one kernel or through 16 bits."""
    from speed_models import tiny_config

    from engine.bench.long_context import build_quantized_model, with_lora

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=512, head_dim=64, intermediate_size=1024)
    model = with_lora(build_quantized_model(config, CUDA), "tunedeck")
    model.train()
    # every layer recomputes (resident layers, automatic, would keep a tiny model's activations on a roomy GPU)
    settings = SpeedConfig(
        metadata_cache=True, checkpointing="offloaded", fp8_base="all", fused_kernels=True, resident_layers=False
    )
    ctl = SpeedController(model, settings, CUDA)
    ctl.offloader.min_offload_bytes = 0
    _, one_pass, _ = ctl.lean.fp8_projections()
    assert one_pass > 0 and "in one pass" in ctl.state()["fp8_base"]["reason"], ctl.state()["fp8_base"]
    results = {}
    for on in (True, False):
        if not on:
            for _, _, wrapper in ctl.lean.installed:
                wrapper.one_pass = False
        logits = run_step(model, ctl)
        results[on] = (logits, grads(model))
        model.zero_grad(set_to_none=True)
    (logits_on, grads_on), (logits_off, grads_off) = results[True], results[False]
    assert grads_on.keys() == grads_off.keys()
    flat_on, flat_off = (torch.cat([g[k].flatten().float() for k in sorted(g)]) for g in (grads_on, grads_off))
    assert float(flat_off.norm()) > 0
    assert relative_error(logits_on, logits_off) < 1e-3
    assert relative_error(flat_on, flat_off) < 1e-2  # LoRA A's gradients are zero at step one (B starts at zero)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 tensor cores"
)
def test_fp8_only_in_the_recompute_keeps_the_16bit_forward_on_gpu() -> None:
    """With fp8 kept out of the forward pass, an offloaded step's logits (and so its loss) are the bf16 path's to
    the bit; only the recompute and the input gradients carry fp8 rounding, less of it than fp8 everywhere."""
    model = bf16_model("llama")
    # every layer recomputes: resident layers (automatic) would keep a tiny model's activations and skip it
    base = SpeedConfig(metadata_cache=True, checkpointing="offloaded", resident_layers=False)
    ctl = SpeedController(model, base, CUDA)
    ctl.offloader.min_offload_bytes = 0
    ref_logits = run_step(model, ctl)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    errors = {}
    for scope in ("all", "recompute"):
        ctl.apply(dataclasses.replace(base, fp8_base=scope))
        assert ctl.state()["fp8_base"]["on"], ctl.state()["fp8_base"]
        logits = run_step(model, ctl)
        got = grads(model)
        model.zero_grad(set_to_none=True)
        errors[scope] = relative_error(logits, ref_logits), max(relative_error(got[k], ref[k]) for k in ref)
        ctl.apply(base)
    assert errors["recompute"][0] == 0.0, errors
    assert 1e-4 < errors["recompute"][1] < errors["all"][1], errors
    print(f"\nlogits, gradients vs bf16 by fp8 scope: {errors}")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 tensor cores"
)
def test_automatic_fp8_keeps_a_qlora_step_16bit_forward_on_gpu() -> None:
    """Left automatic, a 4-bit model under offloaded checkpointing on an fp8 GPU multiplies in fp8 only in the
    recompute and the input gradients: its logits are the 16-bit path's to the bit, its gradients within fp8
    rounding of them, with no host sync."""
    model = tiny_4bit_model()
    # every layer recomputes (resident layers, automatic, could keep a tiny model's activations on a roomy GPU)
    sixteen = SpeedConfig(metadata_cache=True, checkpointing="offloaded", resident_layers=False, fp8_base="off")
    ctl = SpeedController(model, sixteen, CUDA)
    ctl.offloader.min_offload_bytes = 0
    ref_logits, ref = run_step(model, ctl), grads(model)
    model.zero_grad(set_to_none=True)
    ctl.apply(dataclasses.replace(sixteen, fp8_base="auto"))
    state = ctl.state()["fp8_base"]
    assert state["on"] and state["reason"].startswith("automatic:") and "loss stay 16-bit" in state["reason"], state
    run_step(model, ctl)  # the first fp8 step casts each weight once
    model.zero_grad(set_to_none=True)
    with no_host_sync():
        logits = run_step(model, ctl)
    got = grads(model)
    worst = max(relative_error(got[k], ref[k]) for k in ref)
    assert torch.equal(logits, ref_logits) and 1e-4 < worst < 0.25, worst


GRAPHED_STEPS = [[(700, 500, 300)], [(1450,), (800, 600, 100)], [(1500,)], [(600, 600, 300), (1480,)],
                 [(900, 500, 50, 1)]]  # fmt: skip
"""Micro-batches per step: multi-document rows (padded with empty documents for the varlen kernel) and
one-document rows (the causal path) whose buckets recur."""


def nf4_model() -> torch.nn.Module:
    from speed_models import tiny_config

    from engine.bench.long_context import build_quantized_model, with_lora

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, head_dim=64, intermediate_size=512)
    model = with_lora(build_quantized_model(config, CUDA), "tunedeck")
    model.train()
    return model


def graphed_training(kind: str, settings: SpeedConfig) -> tuple[list[float], dict[str, torch.Tensor], SpeedController]:
    model = nf4_model() if kind == "nf4" else bf16_lora_with_float32_adapters()
    ctl = SpeedController(model, settings, CUDA)
    ctl.offloader.min_offload_bytes = 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    losses = []
    for i, step in enumerate(GRAPHED_STEPS):
        batches = [packed_batch(lengths, seed=10 * i + j) for j, lengths in enumerate(step)]
        trained = sum(b.trained_tokens for b in batches)
        losses.append(sum(float(ctl.forward_backward(model, b.to(CUDA), trained)) for b in batches))
        optimizer.step()
        ctl.zero_grad(optimizer)
    updates = {str(i): (p.detach() - p0).float() for i, (p, p0) in enumerate(zip(trainable, start, strict=True))}
    return losses, updates, ctl


def bf16_lora_with_float32_adapters() -> torch.nn.Module:
    return mixed_precision_lora_model("llama", hidden_size=256, head_dim=64, intermediate_size=512).to(CUDA)


@pytest.mark.parametrize(("kind", "checkpointing"), [("bf16", "offloaded"), ("nf4", "offloaded")])
def test_step_graphs_train_as_eager_steps_with_no_sync(kind: str, checkpointing: str) -> None:
    """Micro-steps replayed from CUDA graphs (fused kernels, the fused loss, offloaded copies, the input embedding
    looked up on the host, 4-bit dequantize-once and lean recompute) train as eager ones do, and a replayed
    micro-step makes no host sync."""
    # every layer recomputes and offloads (resident layers, automatic, would keep a tiny model's activations)
    settings = SpeedConfig(checkpointing=checkpointing, host_embedding=True, resident_layers=False)
    eager = graphed_training(kind, dataclasses.replace(settings, step_graphs=False))
    losses, updates, ctl = graphed_training(kind, dataclasses.replace(settings, step_graphs=True))
    assert ctl.state()["step_graphs"]["on"], ctl.state()["step_graphs"]
    assert (ctl.graphs.captured, ctl.graphs.replays) == (2, 5)  # rows of 1 and 4 (padded) documents, 1,536 tokens
    assert relative_error(torch.tensor(losses), torch.tensor(eager[0])) < 2e-2, (losses, eager[0])
    worst = max(relative_error(updates[k], eager[1][k]) for k in updates)
    # bf16 noise in five AdamW updates (near-zero gradients flip sign): the same eager step with every layer run
    # eagerly instead of compiled is as correct, and the replay may differ from eager by no more than it does
    uncompiled = graphed_training(kind, dataclasses.replace(settings, step_graphs=False, fused_kernels=False))[1]
    noise = max(relative_error(uncompiled[k], eager[1][k]) for k in updates)
    print(f"update error, replayed vs eager {worst:.4f}; eager uncompiled vs compiled {noise:.4f}")
    assert worst <= max(0.1, 1.5 * noise), (worst, noise)
    row = packed_batch(GRAPHED_STEPS[-1][0], seed=99).to(CUDA)
    ctl.forward_backward(ctl.model, row, row.trained_tokens)  # its bucket is captured: this replays
    replays = ctl.graphs.replays
    with no_host_sync():
        ctl.forward_backward(ctl.model, row, row.trained_tokens)
    assert ctl.graphs.replays == replays + 1


def graph_pool_bytes() -> int:
    """Bytes allocated (held by tensors) in CUDA graphs' private memory pools."""
    torch.cuda.synchronize()
    pools = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    return sum(s["allocated_size"] for s in pools)


@pytest.mark.parametrize("chunked", [False, True])
def test_dropped_step_graphs_leave_nothing_allocated_in_their_pools(chunked: bool) -> None:
    """Whatever the captures allocated goes with the graphs: nothing of a run (offloader, 4-bit decodes, chunked
    MLPs, the host embedding's rows) keeps a tensor from their pools. The 8B row of 16,384 tokens under 8 GiB once
    found 1.92 GiB still allocated in graph pools after its graphs were dropped."""
    settings = SpeedConfig(
        checkpointing="offloaded", host_embedding=True, chunked_mlp=chunked, step_graphs=True, resident_layers=False
    )
    _, _, ctl = graphed_training("nf4", settings)
    assert ctl.graphs.captured > 0 and graph_pool_bytes() > 0  # the captured losses, at least
    ctl.apply(dataclasses.replace(settings, step_graphs=False))
    gc.collect()
    assert graph_pool_bytes() == 0


def test_a_micro_batch_whose_capture_runs_short_runs_eagerly_with_the_captures_memory_back() -> None:
    """Through StepGraphs, as a run meets it: the capture runs out of memory inside the model's work, and the
    eager run of the same micro-batch that follows finds that memory free again (no cleanup by the caller)."""
    from engine.speed.step_graphs import StepGraphs

    graphs = StepGraphs(CUDA, lambda: [])
    graphs.switch(True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    calls = []

    def body(tree: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(torch.cuda.is_current_stream_capturing())
        held = [torch.empty(64 << 20, device=CUDA).fill_(1.0) for _ in range(4)]  # 1 GiB, alive in these frames
        if calls[-1]:
            raise torch.OutOfMemoryError("out of memory inside the capture")
        return held[0].sum().detach()

    tree = {"x": torch.ones(8, device=CUDA)}
    graphs.run(tree, body)  # eager: compiles, in a run
    after_eager = torch.cuda.memory_reserved()
    loss = graphs.run(tree, body)  # the capture runs short; the same micro-batch runs eagerly
    assert calls == [False, True, False] and float(loss) == float(64 << 20)
    assert graphs.failure is not None and "OutOfMemoryError" in graphs.failure
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - max(before, after_eager) < 64 << 20, (before, torch.cuda.memory_reserved())


def test_a_failed_capture_gives_its_memory_back_and_the_stream_too() -> None:
    """A capture that runs out of memory must not keep its pool's blocks: the eager work after it needs them."""
    from engine.speed.step_graphs import CudaGraphCapture

    capture = CudaGraphCapture()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()

    def runs_short() -> torch.Tensor:
        taken = torch.empty(64 << 20, device=CUDA)  # 256 MiB from the capture's pool
        taken.fill_(1.0)
        raise torch.OutOfMemoryError("out of memory inside the capture")

    with pytest.raises(torch.OutOfMemoryError):
        capture(runs_short)
    torch.cuda.empty_cache()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.cuda.memory_reserved() - before < 32 << 20, (before, torch.cuda.memory_reserved())
    assert float(torch.ones(4, device=CUDA).sum()) == 4.0


DROP_WHILE_A_REPLAY_IS_QUEUED = """
import sys
import torch
from engine.speed.step_graphs import StepGraphs

graphs = StepGraphs(torch.device("cuda"), lambda: [])
if sys.argv[1] == "no-wait":
    graphs.wait = lambda device: None
graphs.switch(True)
tree = {"x": torch.ones(64 << 20, device="cuda")}
body = lambda tree: (tree["x"] * 2.0).sum().detach()  # 256 MiB of the pool once captured
graphs.run(tree, body)  # eager
graphs.run(tree, body)  # captured, first replay
torch.cuda.synchronize()
torch.cuda._sleep(1 << 31)  # about a second of GPU time ahead of the next replay
loss = graphs.run(tree, body)  # queued behind it
graphs.switch(False)  # drops the graphs and gives their pool back
print(float(loss))
"""


def run_drop_while_a_replay_is_queued(mode: str) -> subprocess.CompletedProcess[str]:
    """In a fresh process (an illegal memory access ends the CUDA context) with expandable segments, whose
    freed memory is unmapped."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-c", DROP_WHILE_A_REPLAY_IS_QUEUED, mode]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=HANG_S)


def test_dropping_graphs_while_a_replay_is_queued_waits_for_it() -> None:
    done = run_drop_while_a_replay_is_queued("wait")
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) == pytest.approx(2.0 * (64 << 20), rel=1e-3)


def test_automatic_resident_layers_size_from_gpu_memory_and_follow_the_recompute() -> None:
    """On a GPU the automatic count comes from the planner and the memory this process can reach: all layers of a
    tiny model, only the top one (which costs no peak) under a cap that leaves no room. The gradients are the
    checkpointed path's within bf16 noise (both against a float32 run), with no host sync."""
    model = bf16_model("llama", num_hidden_layers=4).float()
    checkpointed = SpeedConfig(metadata_cache=True, checkpointing="offloaded", resident_layers=False)
    ctl = SpeedController(model, checkpointed, CUDA)
    ctl.offloader.min_offload_bytes = 0
    run_step(model, ctl)
    reference = grads(model)
    model.to(torch.bfloat16)
    run_step(model, ctl)
    plain = grads(model)
    ctl.apply(dataclasses.replace(checkpointed, resident_layers=None))
    state = ctl.state()["resident_layers"]
    assert state["on"] and state["layers"] == 4, state
    run_step(model, ctl)  # the first step compiles the resident layers' regions (compiling syncs, once)
    with no_host_sync():
        run_step(model, ctl)
    resident = grads(model)
    plain_error = max(relative_error(plain[k], reference[k]) for k in reference)
    resident_error = max(relative_error(resident[k], reference[k]) for k in reference)
    assert resident_error <= 1.5 * plain_error + 1e-3, (plain_error, resident_error)
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 2**20) / total)
    try:
        ctl.apply(dataclasses.replace(checkpointed, resident_layers=None))
        # only the top layer stays: backward frees its tensors before the layer below recomputes (no higher peak)
        reason = ctl.state()["resident_layers"]["reason"]
        assert ctl.resident_layers == 1 and "1 of 4 layers" in reason, reason
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
