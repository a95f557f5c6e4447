"""The Triton loss kernel against the eager reference: under Triton's interpreter here, compiled on the GPU tests."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hang import HANG_S

from engine.speed import fused_loss, loss_kernel

ROOT = Path(__file__).resolve().parents[1]

INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch
    from engine.speed import loss_kernel
    from engine.speed.fused_loss import IGNORE_INDEX, softmax_cross_entropy_grad

    results = []
    for rows, vocab, block, dtype, scale, strided in json.loads(sys.argv[1]):
        loss_kernel.BLOCK = block
        g = torch.Generator().manual_seed(rows * vocab)
        wide = (torch.randn(rows, vocab + 8 * strided, generator=g) * 4).to(getattr(torch, dtype))
        logits = wide[:, :vocab]
        labels = torch.randint(0, vocab, (rows,), generator=g)
        labels[1::3] = IGNORE_INDEX
        labels[0] = vocab - 1
        want_loss, want_grad = softmax_cross_entropy_grad(logits.clone(), labels, scale)  # it works in place
        got_loss, got_grad = loss_kernel.softmax_cross_entropy_grad(logits, labels, scale, ignore_index=IGNORE_INDEX)
        results.append({
            "loss": [float(want_loss), float(got_loss)],
            "grad_err": float((got_grad.float() - want_grad.float()).abs().max()),
            "ignored_zero": bool(torch.all(got_grad[1::3] == 0)),
            "dtype": str(got_grad.dtype),
            "shape": list(got_grad.shape),
        })
    print(json.dumps(results))
    """
)

CASES = [
    # rows, vocab, block, dtype, scale, strided rows
    (5, 300, 64, "float32", 1.0, False),  # several blocks, a ragged last one
    (4, 300, 4096, "float32", 0.5, False),  # one block wider than the row
    (6, 300, 64, "bfloat16", 1.0, True),  # 16-bit logits, rows with a stride of their own
    (3, 9000, 4096, "float32", 1.0, False),  # the default block, three steps per row
]


@functools.cache
def interpreted_results() -> list[dict[str, object]]:
    """Every case through the kernel under Triton's interpreter, in a child process (the switch is read at import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED, json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_kernel_follows_the_reference_under_the_interpreter(case: int) -> None:
    pytest.importorskip("triton")
    rows, vocab, _, dtype, _, _ = CASES[case]
    got = interpreted_results()[case]
    want_loss, got_loss = got["loss"]  # type: ignore[misc]
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    # float32: exp rounding only; bfloat16: one rounding of values below 1, which the interpreter may truncate
    assert got["grad_err"] <= (1e-6 if dtype == "float32" else 8e-3)
    assert got["ignored_zero"] and got["dtype"] == f"torch.{dtype}" and got["shape"] == [rows, vocab]


def test_bad_shapes_are_refused_before_any_launch() -> None:
    with pytest.raises(ValueError, match="rows, vocab"):
        loss_kernel.softmax_cross_entropy_grad(
            torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), 1.0, ignore_index=-100
        )
    with pytest.raises(ValueError, match="rows, vocab"):
        loss_kernel.softmax_cross_entropy_grad(
            torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), 1.0, ignore_index=-100
        )


def test_the_kernel_is_offered_on_nvidia_gpus_only() -> None:
    assert not loss_kernel.available(torch.device("cpu"))


def test_the_fused_kernels_switch_picks_the_chunk_function(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_loss.chunk_kernel(cpu, compiled=False) is fused_loss.softmax_cross_entropy_grad
    assert fused_loss.chunk_kernel(cuda, compiled=False) is fused_loss.softmax_cross_entropy_grad
    assert fused_loss.chunk_kernel(cpu, compiled=True) is fused_loss.compiled_softmax_cross_entropy_grad()
    monkeypatch.setattr(loss_kernel, "available", lambda device: device.type == "cuda")
    on_gpu = fused_loss.chunk_kernel(cuda, compiled=True)
    assert isinstance(on_gpu, functools.partial) and on_gpu.func is loss_kernel.softmax_cross_entropy_grad
    assert on_gpu.keywords == {"ignore_index": fused_loss.IGNORE_INDEX}
    monkeypatch.setattr(loss_kernel, "available", lambda device: False)
    assert fused_loss.chunk_kernel(cuda, compiled=True) is fused_loss.compiled_softmax_cross_entropy_grad()
