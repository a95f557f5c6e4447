"""Causal attention kernels on this GPU, side by side: what a training step's attention costs with each.

TuneDeck's packed path runs FlashAttention-2's varlen kernel (``flash_varlen``), which keeps documents apart
within a packed row. A row that holds one document needs no document mask, so it may run a dense causal kernel
instead; this script times the candidates on such rows, each fed the grouped K/V a GQA model has:

* ``flash_varlen``: the engine's packed-row kernel (:func:`engine.speed.metadata_cache.grouped_flash_attention`);
* ``cudnn``: cuDNN's fused kernel, as ``--attention-backend auto`` (Hopper) or ``cudnn`` runs it
  (:func:`engine.speed.metadata_cache.cudnn_causal_attention`);
* ``sdpa``: ``scaled_dot_product_attention`` with the kernel SDPA picks by itself;
* ``cudnn_ragged``: cuDNN's packed (ragged) mode through torch's private op, checked and timed, not used.

Rows of several documents (``--docs``) time ``flash_varlen`` and ``cudnn_ragged`` only: a dense kernel would
attend across their documents. Every variant's output and its three input gradients are compared with float32
attention first (``error``: the largest of the four relative errors); timing is the median of CUDA-event-timed
repetitions, forward alone (as the offloaded forward pass runs it) and forward plus backward.

    python benchmarks/attention_kernels.py --out benchmarks/attention_kernels_h200.json

``--tiny`` runs narrow heads on the CPU with ``sdpa`` only (a dry run, host clock).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.bench import median_ms, report_main
from engine.speed import metadata_cache

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, metadata_cache.PackedAttentionMetadata], torch.Tensor]
"""(T, H, D) queries, (T, H_kv, D) keys and values, the row's metadata -> (T, H, D)."""

WHOLE_ROW_ONLY = ("cudnn", "sdpa")
FLASH = "flash_varlen"


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(0, 1).unsqueeze(0) for t in tensors]


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
    return metadata_cache.grouped_flash_attention(q, k, v, meta, q.shape[-1] ** -0.5, None)


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
    out = metadata_cache.cudnn_causal_attention(*_heads_first(q, k, v), scale=q.shape[-1] ** -0.5)
    return out[0].transpose(0, 1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
    grouped = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(*_heads_first(q, k, v), is_causal=True, enable_gqa=grouped)
    return out[0].transpose(0, 1)


def cudnn_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
    cu, n = meta.cu_seqlens, meta.max_seqlen
    op = torch.ops.aten._cudnn_attention_forward
    return op(q, k, v, None, cu, cu, n, n, True, 0.0, True, False, scale=q.shape[-1] ** -0.5)[0]


KERNELS: dict[str, Kernel] = {"flash_varlen": flash_varlen, "cudnn": cudnn, "sdpa": sdpa, "cudnn_ragged": cudnn_ragged}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Float32 causal attention within each document, K/V repeated to every query head."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for doc_q, doc_k, doc_v in zip(*(t.split(lengths) for t in (q, k, v)), strict=True):
        doc_k, doc_v = (t.repeat_interleave(groups, dim=1) for t in (doc_k, doc_v))
        out = F.scaled_dot_product_attention(*_heads_first(doc_q, doc_k, doc_v), is_causal=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def outputs_and_grads(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor, *args: Any):
    for leaf in leaves:
        leaf.grad = None
    out = fn(*args)
    out.backward(grad.to(out.dtype))
    return [out.detach().float(), *(leaf.grad.float().clone() for leaf in leaves)]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    errors = [float((g - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want, strict=True)]
    return max(errors) if all(e == e for e in errors) else float("nan")


def measure_row(
    name: str, tokens: int, docs: int, heads: tuple[int, int], head_dim: int, device: torch.device, reps: int
) -> dict[str, Any]:
    lengths = [tokens // docs] * (docs - 1) + [tokens - tokens // docs * (docs - 1)]
    g = torch.Generator(device=device).manual_seed(tokens + docs)
    widths = (heads[0], heads[1], heads[1])
    leaves = [torch.randn(tokens, h, head_dim, device=device, generator=g, requires_grad=True) for h in widths]
    grad = torch.randn(tokens, heads[0], head_dim, device=device, generator=g)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = _metadata(lengths, device)
    want = outputs_and_grads(reference, leaves, grad, *leaves, lengths)
    kernel = KERNELS[name]

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        return kernel(*(t.to(dtype) for t in tensors), meta)

    row: dict[str, Any] = {"kernel": name, "tokens": tokens, "docs": docs}
    try:
        row["error"] = relative_error(outputs_and_grads(run, leaves, grad, *leaves), want)
        low = [t.detach().to(dtype).requires_grad_() for t in leaves]
        low_grad = grad.to(dtype)
        cuda = device.type == "cuda"
        with torch.no_grad():
            row["forward_ms"] = median_ms(lambda: kernel(*low, meta), reps, 2, cuda)
        row["forward_backward_ms"] = median_ms(lambda: kernel(*low, meta).backward(low_grad), reps, 2, cuda)
    except RuntimeError as err:
        row["failed"] = str(err).splitlines()[0][:200]
    return row


def _metadata(lengths: list[int], device: torch.device) -> metadata_cache.PackedAttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return metadata_cache.PackedAttentionMetadata(
        backend="varlen",
        cu_seqlens=cu.to(device),
        max_seqlen=max(lengths),
        document_ids=ids.to(device),
        host_cu_seqlens=cu,
        num_tokens=sum(lengths),
    )


def kernels_for(docs: int, device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["sdpa"]
    return [k for k in KERNELS if docs == 1 or k not in WHOLE_ROW_ONLY]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    heads, head_dim = (4, 2) if args.tiny else tuple(args.heads), 16 if args.tiny else args.head_dim
    rows_of = [(64, 1)] if args.tiny else [(t, d) for t in args.tokens for d in args.docs]
    rows = []
    for tokens, docs in rows_of:
        for name in kernels_for(docs, device):
            rows.append(measure_row(name, tokens, docs, heads, head_dim, device, args.reps))
            print(rows[-1], flush=True)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "heads": {"query": heads[0], "key_value": heads[1], "dim": head_dim},
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
        "timing": "median of CUDA-event-timed repetitions" if device.type == "cuda" else "host clock (a dry run)",
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    heads = report["heads"]
    lines = [
        "# Causal attention kernels, side by side",
        "",
        f"Device: {report['device']}, torch {report['torch']}, cuDNN {report['cudnn']}; {report['dtype']}, "
        f"{heads['query']} query and {heads['key_value']} K/V heads of {heads['dim']}, {report['timing']}. "
        "Error: the largest relative error of the output and the three input gradients against "
        "float32 attention. x flash: forward + backward time of `flash_varlen` over this kernel's.",
        "",
        "| tokens | documents | kernel | forward ms | forward + backward ms | x flash | error |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    flash = {(r["tokens"], r["docs"]): r.get("forward_backward_ms") for r in report["rows"] if r["kernel"] == FLASH}
    for r in report["rows"]:
        if "failed" in r:
            lines.append(f"| {r['tokens']:,} | {r['docs']} | {r['kernel']} | failed: {r['failed']} | | | |")
            continue
        base = flash.get((r["tokens"], r["docs"]))
        ratio = f"{base / r['forward_backward_ms']:.2f}" if base else "-"
        lines.append(
            f"| {r['tokens']:,} | {r['docs']} | {r['kernel']} | {r['forward_ms']:.3f} | {r['forward_backward_ms']:.3f} "
            f"| {ratio} | {r['error']:.1e} |"
        )
    return "\n".join([*lines, ""])


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=_ints, default=[4096, 16384], help="row lengths, comma-separated")
    parser.add_argument("--docs", type=_ints, default=[1, 4], help="documents per row, comma-separated")
    parser.add_argument("--heads", type=_ints, default=[32, 8], help="query and K/V heads (Llama-3.1-8B: 32,8)")
    parser.add_argument("--head-dim", type=int, default=128, help="width of a head")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per pass")
    parser.add_argument("--tiny", action="store_true", help="narrow heads on the CPU, sdpa only (a dry run)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/attention_kernels.json"), help="JSON (+ .md)")
    return parser.parse_args(argv)


main = report_main(parse_args, measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
