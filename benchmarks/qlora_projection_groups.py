"""What grouping the projections that share an input would save in a QLoRA step: q/k/v and gate/up.

A Llama-style decoder layer feeds one normalised input to q, k and v, and another to gate and up. TuneDeck runs
each as its own frozen product (its 4-bit weight decoded to 16 bits) plus its own LoRA update ``B(A(x)) · s``, so
the rank-r products run in narrow tiles, k and v run as thin products, and backward sums five input gradients
per group. This script times, per layer and in isolation, three ways of computing those two groups forward
(no gradients, as the offloaded forward pass runs) and forward plus backward (as the recompute and backward run),
each replayed from a CUDA graph so that launch overhead does not count:

* ``separate``: one frozen product and one LoRA update per projection (what runs today);
* ``folded_a``: separate frozen products, but one LoRA A product per group (``x · [A_q; A_k; A_v]ᵀ``) and so one
  A gradient and one input-gradient product for the group's adapters;
* ``grouped``: one frozen product per group over the concatenated 16-bit weights and the folded A products.

The step estimate multiplies the per-layer times by the layer count (the forward pass, then the recompute with
backward; the MLP's down projection and the attention's o projection are the same in every variant and are not
timed). Every variant's outputs and gradients are checked against ``separate`` before timing.

    python benchmarks/qlora_projection_groups.py --out benchmarks/qlora_projection_groups_h200.json

Writes the JSON and a Markdown table beside it. ``--tiny`` runs narrow shapes on the CPU (a dry run, timed with
the host clock).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.bench import report_main
from engine.hardware.shapes import load_shape

VARIANTS = ("separate", "folded_a", "grouped")


@dataclass
class Group:
    """Projections reading one input: frozen 16-bit weights (out, in) and float32 LoRA A (r, in) and B (out, r)."""

    name: str
    weights: list[torch.Tensor]
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    scale: float

    @property
    def widths(self) -> list[int]:
        return [w.shape[0] for w in self.weights]


def make_group(
    name: str, fan_in: int, widths: Sequence[int], rank: int, device: torch.device, dtype: torch.dtype, seed: int
) -> Group:
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * std).to(device)

    weights = [randn(out, fan_in, std=fan_in**-0.5).to(dtype) for out in widths]
    lora_a = [randn(rank, fan_in, std=fan_in**-0.5).requires_grad_() for _ in widths]
    lora_b = [randn(out, rank, std=0.02).requires_grad_() for out in widths]  # trained B: not zero
    return Group(name, weights, lora_a, lora_b, scale=2.0)


class _GroupedProduct(torch.autograd.Function):
    """``x · W_catᵀ`` split into the members' outputs; backward joins their gradients for one input-gradient
    product (a frozen weight needs no gradient of its own)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, widths: list[int]) -> Any:  # type: ignore[override]
        ctx.save_for_backward(weight)
        return tuple(F.linear(x, weight).split(widths, dim=-1))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        (weight,) = ctx.saved_tensors
        return torch.cat(grads, dim=-1) @ weight, None, None


def separate(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    outs = []
    for weight, a, b in zip(group.weights, group.lora_a, group.lora_b, strict=True):
        hidden = F.linear(x, a.to(x.dtype))
        outs.append(F.linear(x, weight) + F.linear(hidden, b.to(x.dtype)) * group.scale)
    return outs


def _lora_updates(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """The members' LoRA updates from one product with their stacked A weights."""
    stacked = torch.cat([a.to(x.dtype) for a in group.lora_a], dim=0)
    hidden = F.linear(x, stacked).split([a.shape[0] for a in group.lora_a], dim=-1)
    return [F.linear(h, b.to(x.dtype)) * group.scale for h, b in zip(hidden, group.lora_b, strict=True)]


def folded_a(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    updates = _lora_updates(x, group)
    return [F.linear(x, weight) + update for weight, update in zip(group.weights, updates, strict=True)]


def grouped(x: torch.Tensor, group: Group, joined: torch.Tensor) -> list[torch.Tensor]:
    bases = _GroupedProduct.apply(x, joined, group.widths)
    return [base + update for base, update in zip(bases, _lora_updates(x, group), strict=True)]


def variant_fn(name: str, group: Group) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    if name == "separate":
        return lambda x: separate(x, group)
    if name == "folded_a":
        return lambda x: folded_a(x, group)
    joined = torch.cat(group.weights, dim=0)  # what a grouped decode would write: one buffer per group
    return lambda x: grouped(x, group, joined)


def gradients(fn: Callable[[torch.Tensor], list[torch.Tensor]], x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """The outputs, and the gradients of a fixed function of them for the input and every LoRA weight."""
    leaf = x.detach().requires_grad_()
    outs = fn(leaf)
    weights = [*group.lora_a, *group.lora_b]
    probe = sum((out.float() * (i + 1) / out.numel()).sum() for i, out in enumerate(outs))
    grads = torch.autograd.grad(probe, [leaf, *weights])
    return [*(out.detach() for out in outs), *grads]


def max_relative_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    return max(
        float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30))
        for g, w in zip(got, want, strict=True)
    )


def _host_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph (after warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_variant(fn: Callable[[torch.Tensor], list[torch.Tensor]], x: torch.Tensor, group: Group, reps: int) -> dict:
    leaf = x.detach().requires_grad_()
    with torch.no_grad():
        grads_out = [torch.ones_like(out) for out in fn(x)]
    params = [*group.lora_a, *group.lora_b, leaf]

    def forward() -> None:
        with torch.no_grad():
            fn(x)

    def forward_backward() -> None:
        torch.autograd.backward(fn(leaf), grads_out, inputs=params)

    timer = _graph_ms if x.is_cuda else _host_ms
    result = {"forward_ms": timer(forward, reps), "forward_backward_ms": timer(forward_backward, reps)}
    for param in params:
        param.grad = None
    return result


def groups_for(shape_name: str, rank: int, device: torch.device, dtype: torch.dtype, tiny: bool) -> list[Group]:
    shape = load_shape(shape_name)
    hidden, q_dim, kv_dim, mlp = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    if tiny:
        hidden, q_dim, kv_dim, mlp = 64, 64, 16, 160
    return [
        make_group("q/k/v", hidden, [q_dim, kv_dim, kv_dim], rank, device, dtype, seed=1),
        make_group("gate/up", hidden, [mlp, mlp], rank, device, dtype, seed=2),
    ]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokens = 64 if args.tiny else args.tokens
    layers = load_shape(args.shape).num_layers
    rows: list[dict[str, Any]] = []
    for group in groups_for(args.shape, args.rank, device, dtype, args.tiny):
        x = torch.randn(tokens, group.weights[0].shape[1], device=device).to(dtype)
        reference = gradients(variant_fn("separate", group), x, group)
        for name in VARIANTS:
            fn = variant_fn(name, group)
            error = max_relative_error(gradients(fn, x, group), reference)
            rows.append({"group": group.name, "variant": name, "max_relative_error": error,
                         **time_variant(fn, x, group, args.reps)})  # fmt: skip
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "shape": f"{args.shape} (narrowed to 64 wide)" if args.tiny else args.shape,
        "timing": "each pass replayed from a CUDA graph" if device.type == "cuda" else "host clock, eager (a dry run)",
        "tokens": tokens,
        "rank": args.rank,
        "layers": layers,
        "rows": rows,
        "step": step_estimate(rows, layers),
    }


def step_estimate(rows: list[dict[str, Any]], layers: int) -> dict[str, dict[str, float]]:
    """Per variant: both groups' forward pass plus recompute-and-backward, over every layer, and the saving."""
    per_layer = {
        name: sum(r["forward_ms"] + r["forward_backward_ms"] for r in rows if r["variant"] == name) for name in VARIANTS
    }
    base = per_layer["separate"]
    return {
        name: {"ms_per_step": round(ms * layers, 2), "saved_ms_per_step": round((base - ms) * layers, 2)}
        for name, ms in per_layer.items()
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Grouped projections: q/k/v and gate/up products in one layer, separate against grouped",
        "",
        f"Device: {report['device']}, torch {report['torch']}; {report['shape']} shapes, {report['tokens']:,} tokens, "
        f"LoRA r{report['rank']}, {report['timing']}, median of the timed passes.",
        "",
        "| group | variant | forward ms | forward + backward ms | max relative error vs separate |",
        "|---|---|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['group']} | {r['variant']} | {r['forward_ms']:.3f} | {r['forward_backward_ms']:.3f} | "
            f"{r['max_relative_error']:.1e} |"
        )
    lines += ["", f"Per step ({report['layers']} layers, forward pass + recompute and backward):", ""]
    lines += ["| variant | ms per step | saved ms per step |", "|---|---:|---:|"]
    for name, step in report["step"].items():
        lines.append(f"| {name} | {step['ms_per_step']:.1f} | {step['saved_ms_per_step']:.1f} |")
    return "\n".join([*lines, ""])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", help="a built-in model shape")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the row")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--reps", type=int, default=20, help="timed replays per pass")
    parser.add_argument("--tiny", action="store_true", help="narrow shapes on the CPU (a dry run)")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/qlora_projection_groups.json"), help="JSON (+ .md)"
    )
    return parser.parse_args(argv)


main = report_main(parse_args, measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
