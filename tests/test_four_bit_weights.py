"""4-bit weights decoded to e4m3 in one pass against bitsandbytes' dequantize-then-cast.

Triton's interpreter runs the kernel here on the CPU. Its casts are not the GPU's: to 16 bits it truncates; to e4m3
it rounds ties away from zero, and where rounding up should carry into the next power of two (125.6 to 128) it drops
the carry (64). So these tests allow one e4m3 step, or that halving, on a few values, and check layouts, scales and
the projection's gradients; a swapped code, a wrong block scale or layout moves values much further. The GPU tests
(tests/test_speed_gpu.py) check the GPU's bits.
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
from hang import HANG_S

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
    results["opcheck"] = True
    print(json.dumps(results))
    """
)


@functools.cache
def interpreted() -> dict[str, object]:
    """The checks above under Triton's interpreter, in a child process (the switch is read at import)."""
    return _interpret(INTERPRETED)


def _interpret(script: str) -> dict[str, object]:
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=HANG_S
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
