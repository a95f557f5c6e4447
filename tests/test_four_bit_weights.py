"""4-bit weights decoded in one pass against bitsandbytes: to 16 bits bit for bit, to e4m3 against dequantize-then-cast.

Triton's interpreter runs the kernel here on the CPU. Its casts are not the GPU's: to 16 bits it truncates; to e4m3
it rounds ties away from zero, and where rounding up should carry into the next power of two (125.6 to 128) it drops
the carry (64). So these tests allow one 16-bit or e4m3 step, or that halving, on a few values, and check layouts,
scales and the projection's gradients; a swapped code, a wrong block scale or layout moves values much further.
The GPU tests (tests/test_speed_gpu.py) require bitsandbytes' bits.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.speed import four_bit_weights

ROOT = Path(__file__).resolve().parents[1]

INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch
    import bitsandbytes.functional as bnb
    from engine.speed import four_bit_weights
    from engine.speed.fp8_base import Fp8Projection, quantize_weight, weight_columns

    def quantized(rows, columns, nested, dtype, seed):
        weight = (torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.03).to(dtype)
        packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=nested)
        return packed, state, bnb.dequantize_4bit(packed, state).to(dtype)

    def compare(got, want):
        if got is None:
            return None
        got32, want32 = got.float(), want.float()
        one_step = (got32 - want32).abs() <= want32.abs() / 8 + 2.0**-9
        power_of_two = torch.frexp(want32)[0].abs() == 0.5
        carry_dropped = power_of_two & (2 * got32 == want32)  # the interpreter's cast, not the kernel
        return {
            "shape": list(got.shape),
            "dtype": str(got.dtype),
            "mismatch": float((got.view(torch.uint8) != want.view(torch.uint8)).float().mean()),
            "beyond_one_step": int((~(one_step | carry_dropped)).sum()),
        }

    results = {"layouts": []}
    for seed, (nested, dtype, rows_out, transposed_out) in enumerate([
        (True, torch.bfloat16, True, False),
        (True, torch.bfloat16, False, True),
        (True, torch.bfloat16, True, True),
        (False, torch.float16, True, True),
    ]):
        packed, state, dense = quantized(64, 1024, nested, dtype, seed)
        scale = weight_columns(dense)[0][:, :1]
        want = quantize_weight(dense, scale)
        forward, backward = four_bit_weights.e4m3_from_4bit(packed, state, scale, dtype, rows_out, transposed_out)
        results["layouts"].append([compare(forward, want), compare(backward, want.t().contiguous())])

    # the projection: forward and input gradient, weights from the codes against the two-pass weights
    packed, state, dense = quantized(128, 512, True, torch.bfloat16, 7)
    columns_out, columns_in = weight_columns(dense)
    x = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    outs = []
    for one_pass in (False, True):
        for keep in (False, True):
            leaf = x.clone().requires_grad_(True)
            out = Fp8Projection.apply(leaf, packed, state, None, columns_out, columns_in, keep, False, one_pass)
            out.float().square().sum().backward()
            outs.append((out.detach().float(), leaf.grad.float()))
    reference_out, reference_grad = outs[0]
    scale = lambda t: float(t.abs().max())
    results["projection"] = [
        [float((o - reference_out).abs().max()) / scale(reference_out),
         float((g - reference_grad).abs().max()) / scale(reference_grad)]
        for o, g in outs[1:]
    ]
    results["shapes"] = [list(outs[2][0].shape), list(outs[2][1].shape)]

    # schema, fake shapes and dispatch agree (what compiled regions and CUDA graphs rely on)
    packed, state, dense = quantized(64, 512, True, torch.bfloat16, 9)
    scale = weight_columns(dense)[0][:, :1]
    args = (packed.reshape(-1).view(torch.uint8), state.absmax, state.state2.absmax, state.state2.code,
            state.offset.reshape(1).float(), state.code, 256, True)
    torch.library.opcheck(four_bit_weights.four_bit_to_e4m3,
                          (*args, scale.reshape(1), 64, 512, 64, torch.bfloat16, True, True))
    torch.library.opcheck(four_bit_weights.four_bit_to_16bit, (*args, 64, 512, 64, torch.bfloat16, 1))
    results["opcheck"] = True

    # 16-bit: bitsandbytes' dequantize_4bit bit for bit
    results["sixteen_bit"] = []
    for seed, (nested, dtype) in enumerate([(True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float16)]):
        packed, state, dense = quantized(64, 1024, nested, dtype, 20 + seed)
        got = four_bit_weights.sixteen_bit_from_4bit(packed, state, dtype)
        step = dense.float().abs() * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
        results["sixteen_bit"].append({
            "shape": list(got.shape), "dtype": str(got.dtype),
            "beyond_one_step": int(((got.float() - dense.float()).abs() > step).sum()),
        })
    print(json.dumps(results))
    """
)


TRAINING = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, "tests")
    from speed_models import grads, packed_batch, step, tiny_config
    from engine.bench.long_context import build_quantized_model, with_lora
    from engine.config import SpeedConfig
    from engine.speed import SpeedController, four_bit_weights

    from types import SimpleNamespace
    covers = four_bit_weights.covers_16bit
    on_cpu = lambda state: covers(SimpleNamespace(**{**vars(state), "absmax": SimpleNamespace(is_cuda=True)}))
    four_bit_weights.covers_16bit = on_cpu  # CPU tensors: the kernel runs under the interpreter
    calls = [0]
    decode = four_bit_weights.sixteen_bit_from_4bit
    def counted(*args):
        calls[0] += 1
        return decode(*args)
    four_bit_weights.sixteen_bit_from_4bit = counted

    torch.manual_seed(0)
    config = tiny_config(
        "llama", hidden_size=512, head_dim=64, num_attention_heads=8, intermediate_size=1024, vocab_size=256
    )
    model = with_lora(build_quantized_model(config, torch.device("cpu")), "tunedeck")
    model.train()
    for name, param in model.named_parameters():  # LoRA B starts at zero: make every adapter's gradient count
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    settings = SpeedConfig(metadata_cache=True, checkpointing="offloaded", lean_recompute=True, dequant_once=True)
    controller = SpeedController(model, settings, torch.device("cpu"))
    batch = packed_batch((40, 30, 20))
    results = {}
    for on in (False, True):
        controller.lean.switch(True, True, one_kernel=on)
        model.zero_grad(set_to_none=True)
        loss, _ = step(model, controller.model_inputs(batch), batch)
        results[on] = float(loss), grads(model)
    (loss_off, grads_off), (loss_on, grads_on) = results[False], results[True]
    worst = max(float((grads_on[k] - grads_off[k]).norm() / grads_off[k].norm()) for k in grads_off)

    # what a compiled region saves for backward (inductor's partitioner) when dequantize-once does not keep it
    four_bit_weights.sixteen_bit_from_4bit = decode  # the counter's side effect would keep Dynamo out
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from engine.speed.lean_recompute import _Decoded
    import bitsandbytes.functional as bnb
    weight = (torch.randn(64, 1024) * 0.02).to(torch.bfloat16)
    packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    saved = {}
    def forward_graph(gm, inputs):
        outputs = [node for node in gm.graph.nodes if node.op == "output"][0].args[0]
        saved["forward"] = [list(out.meta["val"].shape) for out in outputs[1:] if "val" in out.meta]
        return make_boxed_func(gm.forward)
    def backward_graph(gm, inputs):
        saved["backward"] = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        return make_boxed_func(gm.forward)
    backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=backward_graph,
                           partition_fn=min_cut_rematerialization_partition)
    def project(x):
        return _Decoded.apply(x, packed, state, None, False, True)
    leaf = torch.randn(5, 1024, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(project, backend=backend)(leaf).float().sum().backward()
    print(json.dumps({"losses": [loss_off, loss_on], "worst_grad": worst, "calls": calls[0],
                      "one_kernel": controller.lean.one_kernel_projections(), "grads": len(grads_off),
                      "saved": saved}))
    """
)
"""A 4-bit model trained one step with offloaded checkpointing, dequantize-once and lean recompute, its weights
decoded by bitsandbytes and then by the one-pass kernel (under Triton's interpreter)."""


@functools.cache
def interpreted_training() -> dict[str, object]:
    return _interpret(TRAINING)


@functools.cache
def interpreted() -> dict[str, object]:
    """The checks above under Triton's interpreter, in a child process (the switch is read at import)."""
    return _interpret(INTERPRETED)


def _interpret(script: str) -> dict[str, object]:
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=500
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", range(4))
def test_each_layout_follows_dequantize_then_cast(case: int) -> None:
    rows_out, transposed_out = [(True, False), (False, True), (True, True), (True, True)][case]
    dtype = "torch.float8_e4m3fn"
    forward, backward = interpreted()["layouts"][case]  # type: ignore[index]
    for wanted, got, shape in ((rows_out, forward, [64, 1024]), (transposed_out, backward, [1024, 64])):
        if not wanted:
            assert got is None
            continue
        assert got["shape"] == shape and got["dtype"] == dtype
        assert got["beyond_one_step"] == 0  # a swapped nibble, a wrong block scale or layout moves far more
        assert got["mismatch"] < 0.1


@pytest.mark.slow
def test_the_projection_gives_the_two_pass_products_and_gradients() -> None:
    results = interpreted()
    assert results["shapes"] == [[3, 5, 128], [3, 5, 512]]
    for out_error, grad_error in results["projection"]:  # type: ignore[union-attr]
        # the interpreter's halved values on a few weights (about 0.1); a wrong weight layout or scale gives ~1
        assert out_error < 0.2 and grad_error < 0.2


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3))
def test_sixteen_bit_weights_are_bitsandbytes_dequantize_bit_for_bit(case: int) -> None:
    got = interpreted()["sixteen_bit"][case]  # type: ignore[index]
    assert got["shape"] == [64, 1024]
    assert got["dtype"] == ["torch.bfloat16", "torch.bfloat16", "torch.float16"][case]
    assert got["beyond_one_step"] == 0  # the interpreter truncates to 16 bits; the GPU test requires every bit


@pytest.mark.slow
def test_a_4bit_model_trains_on_the_kernels_weights_as_on_bitsandbytes() -> None:
    got = interpreted_training()
    assert got["one_kernel"] == 14 and got["calls"] >= 14 * 2  # every projection of 2 layers, in two passes or more
    loss_off, loss_on = got["losses"]  # type: ignore[misc]
    assert abs(loss_on - loss_off) <= 1e-3 * abs(loss_off)
    # the interpreter truncates each weight to 16 bits (one step, ~0.4%); a wrong weight moves gradients by ~1
    assert 0.0 <= got["worst_grad"] < 0.05, got  # type: ignore[operator]


@pytest.mark.slow
def test_compiled_regions_decode_again_for_backward_instead_of_keeping_the_weight() -> None:
    """Inductor's partitioner must not fold backward's decode into the forward's: that would keep every 16-bit
    weight alive from its forward to its backward (out of memory at 16,384 tokens under 8 GiB)."""
    saved = interpreted_training()["saved"]
    assert saved["forward"] and [64, 1024] not in saved["forward"], saved  # type: ignore[index]
    assert "tunedeck.four_bit_to_16bit.default" in saved["backward"], saved  # type: ignore[index]


@pytest.mark.slow
def test_the_op_passes_torchs_custom_op_checks() -> None:
    assert interpreted()["opcheck"] is True


def quant_state(rows: int, columns: int, device: str = "cuda", **changes: object) -> SimpleNamespace:
    fields: dict[str, object] = {
        "shape": torch.Size((rows, columns)),
        "blocksize": 64,
        "quant_type": "nf4",
        "code": torch.zeros(16),
        "absmax": SimpleNamespace(is_cuda=device == "cuda"),
    }
    fields.update(changes)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    ("state", "covered"),
    [
        (quant_state(14336, 4096), True),
        (quant_state(1024, 4096), True),
        (quant_state(4096, 12288), True),
        (quant_state(4096, 4096, device="cpu"), False),  # the CPU keeps the two-pass path
        (quant_state(4096, 4000), False),  # rows that the wide tile does not divide
        (quant_state(100, 4096), False),
        (quant_state(4096, 4096, blocksize=0), False),
        (quant_state(4096, 4096, quant_type="int8"), False),
        (quant_state(4096, 4096, quant_type="fp4"), False),  # not checked against bitsandbytes on a GPU
        (quant_state(4096, 4096, code=None), False),
        (SimpleNamespace(shape=torch.Size((2, 3, 4))), False),
    ],
)
def test_covers_only_what_the_kernel_handles(
    state: SimpleNamespace, covered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(four_bit_weights, "_triton_available", lambda: True)
    assert four_bit_weights.covers(state) is covered


def test_without_triton_nothing_is_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(four_bit_weights, "_triton_available", lambda: False)
    assert not four_bit_weights.covers(quant_state(14336, 4096))
