"""``tunedeck bench``: stock transformers+PEFT against each speed optimization, on one GPU, in one run.

Everything is measured in the same process on the same packed batch: ms/step (median after warm-up), tokens/s,
peak VRAM, device->host syncs per step (counted with CUDA sync debug mode) and MFU against a bf16 matmul peak
measured in the same run. Models are random-init from architecture configs (nothing is downloaded), and this
module imports neither Qt nor ``datasets``, so it runs on a bare GPU machine: ``python -m engine.bench``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from engine.config import SpeedConfig
from engine.packing import PackedBatch, TokenizedExample, collate

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

DENSE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # smoke test of the bench itself
        model_type="qwen3",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=65536,
    ),
}

MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4
    ),
}

# Variants of the dense runs: name -> (metadata cache, checkpointing).
DENSE_VARIANTS: dict[str, tuple[bool, Literal["none", "standard", "offloaded"]]] = {
    "stock": (False, "none"),
    "metadata_cache": (True, "none"),
    "stock+standard_ckpt": (False, "standard"),
    "stock+offloaded_ckpt": (False, "offloaded"),
    "metadata_cache+standard_ckpt": (True, "standard"),
    "all_on+offloaded_ckpt": (True, "offloaded"),
}
LONG_VARIANTS = ("metadata_cache+standard_ckpt", "all_on+offloaded_ckpt")
MOE_MODES = {"eager": "eager", "stock_grouped_mm": "grouped_mm", "bincount": "bincount", "sync-free": "sync-free"}


# --- measuring -------------------------------------------------------------------------------------------------


@contextmanager
def count_syncs() -> Iterator[list[int]]:
    """Counts device->host synchronisations (CUDA sync debug mode warnings) inside the block."""
    counter = [0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default")
    counter[0] = sum("synchronizing" in str(w.message) for w in caught)


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> dict[str, Any]:
    """Median ms/step after warm-up, peak memory over the timed steps, syncs in one extra step."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated()
    with count_syncs() as syncs:
        step()
    return {"ms_per_step": statistics.median(times), "ms_all": times, "peak_vram_gib": peak / 2**30, "syncs": syncs[0]}


def matmul_peak_tflops(n: int = 8192, iters: int = 30) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


# --- dense models -----------------------------------------------------------------------------------------------


def packed_row(tokens: int, vocab: int, seed: int = 0, shortest: int = 128, longest: int = 2048) -> PackedBatch:
    """One packed row of exactly ``tokens`` tokens: documents of random length in [shortest, longest]."""
    g = torch.Generator().manual_seed(seed)
    docs, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(shortest, longest + 1, (1,), generator=g)))
        ids = tuple(torch.randint(0, vocab, (n,), generator=g).tolist())
        docs.append(TokenizedExample(ids, ids))
        left -= n
    return collate(docs)


def build_lora_model(shape: dict[str, Any], device: torch.device) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(shape)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    peft_model.train()
    return peft_model


def model_flops(model: Any, batch: PackedBatch) -> float:
    """Useful training FLOPs of one step with a frozen base: 4·N·T for the matmuls (forward + input gradients,
    no weight gradients), 3× the causal per-document attention forward, lm_head included, recompute excluded."""
    config = model.get_base_model().config
    linear = sum(
        m.weight.numel()
        for name, m in model.get_base_model().named_modules()
        if isinstance(m, torch.nn.Linear) and "lora" not in name
    )
    tokens = batch.num_tokens
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention_fwd = 2 * sum(n * n for n in batch.doc_lengths) * heads * head_dim * config.num_hidden_layers
    return 4 * linear * tokens + 3 * attention_fwd


def dense_step(model: Any, controller: Any, batch: PackedBatch, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    n = batch.trained_tokens

    def step() -> None:
        inputs = controller.model_inputs(batch)
        out = model(**inputs, labels=batch.labels, num_items_in_batch=n)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_dense(name: str, args: argparse.Namespace, peak_tflops: float) -> list[dict[str, Any]]:
    from engine.speed import SpeedController

    device = torch.device("cuda")
    model = build_lora_model(DENSE_SHAPES[name], device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    controller = SpeedController(model, SpeedConfig(metadata_cache=False, checkpointing="none"), device)
    rows = []
    for tokens, variants in ((args.tokens, list(DENSE_VARIANTS)), (args.long_tokens, list(LONG_VARIANTS))):
        if tokens <= 0:
            continue
        batch = packed_row(tokens, DENSE_SHAPES[name]["vocab_size"]).to(device)
        flops = model_flops(model, batch)
        for variant in variants:
            cache, ckpt = DENSE_VARIANTS[variant]
            controller.apply(SpeedConfig(metadata_cache=cache, checkpointing=ckpt, moe_routing="stock"))
            row = {"model": name, "tokens": tokens, "variant": variant, "state": controller.state()}
            step = dense_step(model, controller, batch, optimizer)
            row.update(_guarded(functools.partial(time_steps, step, args.warmup, args.steps)))
            if "ms_per_step" in row:
                row["tokens_per_s"] = tokens / row["ms_per_step"] * 1e3
                row["mfu"] = flops / (row["ms_per_step"] / 1e3) / (peak_tflops * 1e12)
            print(_row_line(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    controller.apply(SpeedConfig(metadata_cache=False, checkpointing="none"))
    return rows


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A failed variant (e.g. out of memory) becomes an error entry instead of ending the whole run."""
    try:
        return fn()
    except Exception as err:  # reported in the table
        torch.cuda.empty_cache()
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def _row_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']:>14} {row['tokens']:>6} {row['variant']:<30} ERROR {row['error']}"
    return (
        f"{row['model']:>14} {row['tokens']:>6} {row['variant']:<30} {row['ms_per_step']:9.1f} ms "
        f"{row.get('tokens_per_s', 0):9.0f} tok/s {row['peak_vram_gib']:6.2f} GiB syncs {row['syncs']}"
    )


# --- MoE blocks -------------------------------------------------------------------------------------------------


def build_moe_block(name: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoConfig

    settings = dict(MOE_SHAPES[name])
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, num_hidden_layers=1, num_attention_heads=32, **settings)
    block_class: Any
    if model_type == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as block_class
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as block_class
    torch.manual_seed(0)
    with torch.device(device):
        block = block_class(config).to(dtype)
    for pname, param in block.named_parameters():
        torch.nn.init.normal_(param, std=0.02)
        # Expert weights need a gradient, as they do with LoRA on the experts; the router stays frozen.
        param.requires_grad_("experts" in pname)
    return block, config


def bench_moe(name: str, dtype: torch.dtype, args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.speed import moe_routing

    device = torch.device("cuda")
    moe_routing.register_experts_implementations()
    block, config = build_moe_block(name, dtype, device)
    x = torch.randn(1, args.moe_tokens, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    rows = []
    for label, mode in MOE_MODES.items():
        config._experts_implementation = moe_routing.IMPLEMENTATION_NAMES.get(mode, mode)

        def step() -> None:
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)
            x.grad = None
            for p in block.parameters():
                p.grad = None

        row = {"block": name, "dtype": str(dtype).removeprefix("torch."), "tokens": args.moe_tokens, "mode": label}
        row.update(_guarded(functools.partial(time_steps, step, args.warmup, max(args.steps, 10))))
        print(
            f"{name:>14} {row['dtype']:>8} {label:<18} {row.get('ms_per_step', float('nan')):8.2f} ms "
            f"syncs {row.get('syncs')} {row.get('error', '')}",
            flush=True,
        )
        rows.append(row)
    return rows


# --- report -----------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import peft
    import transformers

    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and "ms_per_step" in r), None)


def ratios(dense: list[dict[str, Any]], moe: list[dict[str, Any]], tokens: int, long_tokens: int) -> dict[str, Any]:
    """The issue's targets as ratios measured in this run."""
    out: dict[str, Any] = {}
    for model in {r["model"] for r in dense}:
        pairs = {
            "all_on_vs_stock": ("stock", "metadata_cache", tokens),
            "all_on_vs_stock_with_ckpt": ("stock+standard_ckpt", "all_on+offloaded_ckpt", tokens),
            "offloaded_ckpt_alone_vs_standard": ("stock+standard_ckpt", "stock+offloaded_ckpt", tokens),
            "offloaded_vs_standard_step_time_long": (
                "all_on+offloaded_ckpt",
                "metadata_cache+standard_ckpt",
                long_tokens,
            ),
        }
        for key, (base, fast, t) in pairs.items():
            a, b = _find(dense, model=model, variant=base, tokens=t), _find(dense, model=model, variant=fast, tokens=t)
            if a and b:
                out[f"{model}:{key}"] = a["ms_per_step"] / b["ms_per_step"]
        a = _find(dense, model=model, variant="metadata_cache+standard_ckpt", tokens=long_tokens)
        b = _find(dense, model=model, variant="all_on+offloaded_ckpt", tokens=long_tokens)
        if a and b:
            out[f"{model}:offloaded_peak_vram_saved_gib_long"] = a["peak_vram_gib"] - b["peak_vram_gib"]
    for block in {r["block"] for r in moe}:
        for dtype in ("bfloat16", "float16"):
            eager = _find(moe, block=block, dtype=dtype, mode="eager")
            for mode in ("stock_grouped_mm", "bincount", "sync-free"):
                row = _find(moe, block=block, dtype=dtype, mode=mode)
                if eager and row:
                    out[f"{block}:{dtype}:{mode}_vs_eager"] = eager["ms_per_step"] / row["ms_per_step"]
    return out


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# TuneDeck speed benchmark — {env['gpu']} (sm_{env['capability'].replace('.', '')})",
        "",
        f"{env['date']}; torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
        f"peft {env['peft']}; bf16 matmul peak measured in this run: {report['peak_tflops']:.0f} TFLOP/s.",
        "Random-init models from architecture configs, LoRA r16 on all 7 projections, AdamW, one packed row.",
        "",
        "| model | tokens | variant | ms/step | tokens/s | peak VRAM GiB | syncs/step | MFU |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["dense"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['variant']} | error: {r['error'][:80]} | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['tokens']:,} | {r['variant']} | {r['ms_per_step']:,.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_vram_gib']:.2f} | {r['syncs']} | {r['mfu'] * 100:.1f}% |"
        )
    lines += ["", "| MoE block | dtype | tokens | routing | ms fwd+bwd | syncs |", "|---|---|---:|---|---:|---:|"]
    for r in report["moe"]:
        ms = f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else f"error: {r['error'][:60]}"
        lines.append(f"| {r['block']} | {r['dtype']} | {r['tokens']:,} | {r['mode']} | {ms} | {r.get('syncs', '')} |")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in sorted(report["ratios"].items())]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tunedeck bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b", help=f"dense shapes: {', '.join(DENSE_SHAPES)}")
    parser.add_argument(
        "--moe-blocks", default="qwen3-30b-a3b,gpt-oss-20b", help=f"MoE shapes: {', '.join(MOE_SHAPES)}"
    )
    parser.add_argument("--moe-dtypes", default="bfloat16,float16")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row")
    parser.add_argument("--long-tokens", type=int, default=65536, help="row length of the checkpointing runs (0: skip)")
    parser.add_argument("--moe-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/speed.json"), help="JSON output path")
    parser.add_argument("--table", type=Path, default=None, help="markdown table path (default: beside --out)")
    parser.add_argument(
        "--long-context", action="store_true", help="longest 8B QLoRA row under 8/16/24 GiB (its own options)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--long-context" in argv:
        from engine.bench_long_context import main as long_context_main

        return long_context_main([arg for arg in argv if arg != "--long-context"])
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tunedeck bench needs an NVIDIA GPU (torch sees none)", file=sys.stderr)
        return 2
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    dense = [row for name in filter(None, args.models.split(",")) for row in bench_dense(name, args, peak)]
    moe = [
        row
        for name in filter(None, args.moe_blocks.split(","))
        for dtype in filter(None, args.moe_dtypes.split(","))
        for row in bench_moe(name, getattr(torch, dtype), args)
    ]
    report = {
        "environment": environment(),
        "peak_tflops": peak,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "mfu_formula": model_flops.__doc__,
        "dense": dense,
        "moe": moe,
        "ratios": ratios(dense, moe, args.tokens, args.long_tokens),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    table = markdown(report)
    (args.table or args.out.with_suffix(".md")).write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
