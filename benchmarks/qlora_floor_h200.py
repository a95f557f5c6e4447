"""The GPU-time floor of one QLoRA step: Llama-3.1-8B shape, one 4,096-token row, whole-layer recompute.

Times, on one GPU and in isolation, the bf16 products and the attention kernels one training step of the
automatic 8 GiB path must run (forward, the offloaded recompute, the input gradients; the frozen weights need
no weight gradients), and sums them over the 32 layers. It also times one large square product (the card's
practical peak) and compares the attention kernels torch offers for a whole-row causal document.

    python benchmarks/qlora_floor_h200.py --out benchmarks/qlora_floor_h200.json

Writes the JSON and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.bench import median_ms

TOKENS = 4096
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32
PROJECTIONS = {  # name: (in, out)
    "q": (HIDDEN, HEADS * HEAD_DIM),
    "k": (HIDDEN, KV_HEADS * HEAD_DIM),
    "v": (HIDDEN, KV_HEADS * HEAD_DIM),
    "o": (HEADS * HEAD_DIM, HIDDEN),
    "gate": (HIDDEN, MLP),
    "up": (HIDDEN, MLP),
    "down": (MLP, HIDDEN),
}


def product_ms(rows: int, inner: int, outer: int) -> dict[str, float]:
    """Forward ``x @ w.T`` and input gradient ``dy @ w`` for a frozen (outer, inner) weight."""
    x = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(outer, inner, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, outer, device="cuda", dtype=torch.bfloat16)
    return {"forward": median_ms(lambda: F.linear(x, w)), "input_grad": median_ms(lambda: dy @ w)}


def peak_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / median_ms(lambda: a @ b) / 1e9


def attention_ms() -> dict[str, dict[str, float | str]]:
    """Forward and forward+backward of one layer's whole-row causal attention, per kernel."""
    q = torch.randn(1, HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    groups = HEADS // KV_HEADS

    def grouped(backend: SDPBackend | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        return run

    def repeated(backend: SDPBackend) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            kk, vv = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

        return run

    kernels = {
        "sdpa default, grouped (TuneDeck's whole-row path)": grouped(None),
        "sdpa flash, grouped": grouped(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn, grouped": grouped(SDPBackend.CUDNN_ATTENTION),
        "sdpa cudnn, heads repeated": repeated(SDPBackend.CUDNN_ATTENTION),
        "sdpa flash, heads repeated": repeated(SDPBackend.FLASH_ATTENTION),
    }
    out: dict[str, dict[str, float | str]] = {}
    for name, fn in kernels.items():
        try:
            forward = median_ms(lambda fn=fn: fn().detach())
            both = median_ms(lambda fn=fn: fn().backward(grad))
            out[name] = {"forward": forward, "forward_backward": both, "backward": both - forward}
        except RuntimeError as err:
            out[name] = {"error": str(err).splitlines()[0][:160]}
        q.grad = k.grad = v.grad = None
    return out


def floor(products: dict[str, dict[str, float]], lm_head: dict[str, float], attention: dict[str, float]) -> dict:
    """Whole-layer recompute: each layer's products run forward twice (forward, recompute) and once for the input
    gradient; the output head once forward and once for its input gradient (the fused loss computes both in one
    pass and keeps no logits)."""
    forward = sum(p["forward"] for p in products.values())
    input_grad = sum(p["input_grad"] for p in products.values())
    head = lm_head["forward"] + lm_head["input_grad"]
    gemm = LAYERS * (2 * forward + input_grad) + head
    gemm_no_recompute = LAYERS * (forward + input_grad) + head
    attn = LAYERS * (2 * attention["forward"] + attention["backward"])
    attn_no_recompute = LAYERS * attention["forward_backward"]
    lean = gemm - LAYERS * products["down"]["forward"] + attn  # lean recompute skips the down projection
    return {
        "gemm_ms": gemm,
        "attention_ms": attn,
        "floor_ms": gemm + attn,
        "floor_tokens_per_s": TOKENS / (gemm + attn) * 1e3,
        "lean_floor_ms": lean,
        "lean_floor_tokens_per_s": TOKENS / lean * 1e3,
        "no_recompute_floor_ms": gemm_no_recompute + attn_no_recompute,
        "step_gemm_tflop": step_flops() / 1e12,
        "gemm_tflops": step_flops() / gemm / 1e9,
    }


def step_flops() -> float:
    per_layer = sum(2 * TOKENS * i * o for i, o in PROJECTIONS.values())
    return LAYERS * 3 * per_layer + 2 * 2 * TOKENS * HIDDEN * VOCAB


def markdown(report: dict[str, Any]) -> str:
    f = report["floor"]
    lines = [
        "# The GPU-time floor of one QLoRA step (Llama-3.1-8B shape, 4,096 tokens, whole-layer recompute)",
        "",
        f"GPU: {report['gpu']}, torch {report['torch']}. Each kernel timed alone (CUDA events, median of 20).",
        "",
        f"- Large square bf16 product (8,192^3): **{report['peak_tflops']:.0f} TFLOP/s**.",
        f"- The step's frozen-weight products ({f['step_gemm_tflop']:.0f} TFLOP: 32 layers x forward, recompute "
        f"and input gradient; output head x 2): **{f['gemm_ms']:.0f} ms** ({f['gemm_tflops']:.0f} TFLOP/s).",
        f"- Attention (default kernel), forward twice and backward once per layer: **{f['attention_ms']:.0f} ms**.",
        f"- Floor of those two alone: **{f['floor_ms']:.0f} ms/step = {f['floor_tokens_per_s']:,.0f} tokens/s**, "
        "before norms, rotary embedding, activation, LoRA, loss, 4-bit decodes and optimizer.",
        f"- The same with lean recompute, which skips the down projection's product in the recompute (its output "
        f"feeds only the residual sum the recompute throws away; TuneDeck's automatic path): **{f['lean_floor_ms']:.0f}"
        f" ms/step = {f['lean_floor_tokens_per_s']:,.0f} tokens/s**.",
        f"- The same without recompute (needs every layer's activations kept): {f['no_recompute_floor_ms']:.0f} ms.",
        "",
        "| projection | in | out | forward ms | input-gradient ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in report["products"].items():
        i, o = PROJECTIONS.get(name, (HIDDEN, VOCAB))
        lines.append(f"| {name} | {i:,} | {o:,} | {p['forward']:.3f} | {p['input_grad']:.3f} |")
    lines += ["", "| attention kernel (one layer) | forward ms | backward ms |", "|---|---:|---:|"]
    for name, a in report["attention"].items():
        if "error" in a:
            lines.append(f"| {name} | {a['error']} | |")
        else:
            lines.append(f"| {name} | {a['forward']:.3f} | {a['backward']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON (+ .md beside)")
    parser.add_argument("--rederive", action="store_true", help="recompute the floors from --out's measured times")
    args = parser.parse_args(argv)
    if args.rederive:
        report = json.loads(args.out.read_text())
        products = report["products"]
        layer_products = {k: v for k, v in products.items() if k != "lm_head"}
        default = report["attention"]["sdpa default, grouped (TuneDeck's whole-row path)"]
        report["floor"] = floor(layer_products, products["lm_head"], default)
        args.out.write_text(json.dumps(report, indent=1))
        print(markdown(report))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    products = {name: product_ms(TOKENS, i, o) for name, (i, o) in PROJECTIONS.items()}
    products["lm_head"] = product_ms(TOKENS, HIDDEN, VOCAB)
    attention = attention_ms()
    default = attention["sdpa default, grouped (TuneDeck's whole-row path)"]
    layer_products = {k: v for k, v in products.items() if k != "lm_head"}
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": TOKENS,
        "peak_tflops": peak_tflops(),
        "products": products,
        "attention": attention,
        "floor": floor(layer_products, products["lm_head"], default),  # type: ignore[arg-type]
    }
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
