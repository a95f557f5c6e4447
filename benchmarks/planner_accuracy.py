"""Measured vs predicted peak training memory, and planner-chosen batches under emulated 8-24 GiB cards.

Builds each shape from its config (random init, saved to a temp folder and loaded through the engine's own
loader, so QLoRA goes through bitsandbytes exactly as a user's run does), adds LoRA r16 on all linear layers,
and runs real AdamW steps through the engine's speed controller on one packed row of documents of 128-2,048
tokens. Peak = the true peak over the steps (the allocator's peak reserved memory, step graphs' pool and cached
blocks included: engine.hardware.vram), with the allocated peak beside it; the CUDA context is not included.
Rows measured before the true peak (the committed planner_accuracy.json) hold ``torch.cuda.max_memory_allocated``
under ``peak_bytes`` and no ``true_peak_bytes``.
Then, for each cap, the planner picks LoRA/QLoRA, checkpointing and tokens per batch for a card of that size and
the same steps run under ``torch.cuda.set_per_process_memory_fraction``.

    PYTHONPATH=. python benchmarks/planner_accuracy.py --out $OUT/planner_accuracy.json
    python benchmarks/planner_accuracy.py --report benchmarks/planner_accuracy.json  # re-print the table
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.hardware.planner import GIB, TrainSetup, choose_memory_settings, estimate_memory, usable_bytes
from engine.hardware.shapes import BUILTIN_CONFIGS, load_shape


def packed_batch(tokens: int, vocab: int, seed: int) -> Any:
    from engine.data.packing import IGNORE_INDEX, TokenizedExample, collate

    rng = random.Random(seed)
    docs, left = [], tokens
    while left > 0:
        n = min(left, rng.randint(128, 2048))
        ids = tuple(rng.randrange(vocab) for _ in range(n))
        docs.append(TokenizedExample(ids, (IGNORE_INDEX, *ids[1:])))
        left -= n
    return collate(docs)


def build_model(name: str, qlora: bool, folder: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.config import LoraConfig, ModelConfig
    from engine.model.load import add_lora, load_base_model

    raw = dict(BUILTIN_CONFIGS[name])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    config.use_cache = False
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    base = load_base_model(ModelConfig(name=str(folder), qlora=qlora), torch.device("cuda"), torch.bfloat16)
    model = add_lora(base, LoraConfig(rank=16), qlora)
    model.train()
    return model


def train_steps(model: Any, controller: Any, optimizer: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Run ``steps`` optimizer steps; the true and allocated peaks over all of them, time of the last."""
    import torch

    from engine.hardware.vram import reset_step_peak

    gc.collect()
    torch.cuda.empty_cache()
    reset_step_peak(torch.device("cuda", torch.cuda.current_device()))
    on_device = batch.to("cuda")
    times = []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            inputs = controller.model_inputs(on_device)
            loss = model(**inputs, labels=on_device.labels, num_items_in_batch=on_device.trained_tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss, inputs
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as err:
        optimizer.zero_grad(set_to_none=True)
        return {"oom": True, "error": str(err).splitlines()[0], **peak_record()}
    return {
        "oom": False,
        **peak_record(),
        "step_s": times[-1],
        "tokens_per_s": batch.num_tokens / times[-1],
    }


def peak_record() -> dict[str, Any]:
    """The peaks since the last reset: ``peak_bytes`` and ``true_peak_bytes`` the true peak (reserved),
    ``allocated_peak_bytes`` live tensors only (what ``peak_bytes`` held in rows before the true peak)."""
    import torch

    from engine.hardware.vram import read_step_peak

    peak = read_step_peak(torch.device("cuda", torch.cuda.current_device()))
    return {
        "peak_bytes": peak.true_peak, "true_peak_bytes": peak.true_peak, "allocated_peak_bytes": peak.allocated,
        "reserved_bytes": peak.reserved, "driver_bytes": peak.driver,
    }  # fmt: skip


def setup_for(qlora: bool, mode: str, tokens: int, cache: bool) -> TrainSetup:
    attention = "varlen" if cache else "sdpa"
    return TrainSetup(tokens=tokens, qlora=qlora, checkpointing=mode, attention=attention)


def measure_shape(name: str, qlora: bool, args: argparse.Namespace, deadline: float, rows: list[dict]) -> None:
    import torch

    from engine.config import SpeedConfig
    from engine.speed import SpeedController

    shape = load_shape(name)
    total = torch.cuda.get_device_properties(0).total_memory
    cc = torch.cuda.get_device_capability(0)
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(name, qlora, Path(folder))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    controller = SpeedController(model, SpeedConfig(metadata_cache=True, checkpointing="none"), torch.device("cuda"))
    static = torch.cuda.memory_allocated()
    caches = [True, False] if args.stock and not qlora else [True]
    for cache in caches:
        for mode in args.modes:
            for tokens in args.tokens:
                setup = setup_for(qlora, mode, tokens, cache)
                predicted = estimate_memory(shape, setup, cc)
                row: dict[str, Any] = {
                    "kind": "accuracy", "shape": name, "qlora": qlora, "checkpointing": mode, "tokens": tokens,
                    "metadata_cache": cache, "setup": setup.__dict__, "static_bytes": static,
                    "predicted_bytes": predicted.peak, "attention": predicted.attention,
                }  # fmt: skip
                if predicted.peak > 0.92 * total:
                    row["skipped"] = f"predicted {predicted.gib():.0f} GiB exceeds this GPU"
                elif time.monotonic() > deadline:
                    row["skipped"] = "time limit"
                else:
                    controller.apply(SpeedConfig(metadata_cache=cache, checkpointing=mode))
                    row.update(train_steps(model, controller, optimizer, packed_batch(tokens, shape.vocab_size, 0), 2))
                    row["resolved"] = controller.state()
                rows.append(row)
                report_row(row)
                flush(args, rows)
    for cap in args.caps:
        if time.monotonic() > deadline:
            break
        rows.append(cap_run(shape, qlora, cap, model, controller, optimizer, total, cc))
        report_row(rows[-1])
        flush(args, rows)
    del model, optimizer, controller
    gc.collect()
    torch.cuda.empty_cache()


def cap_run(
    shape: Any, qlora: bool, cap: int, model: Any, controller: Any, optimizer: Any, total: int, cc: Any
) -> dict:
    import torch

    from engine.config import SpeedConfig

    base = setup_for(qlora, "none", 2048, True)
    plan = choose_memory_settings(shape, usable_bytes(cap * GIB), base=base, compute_capability=cc, qlora=qlora)
    row: dict[str, Any] = {
        "kind": "cap", "shape": shape.name, "qlora": qlora, "cap_gib": cap, "fits": plan.fits,
        "checkpointing": plan.checkpointing, "tokens": plan.tokens, "reasons": plan.reasons,
        "predicted_bytes": plan.estimate.peak,
    }  # fmt: skip
    if not plan.fits:
        return row
    controller.apply(SpeedConfig(metadata_cache=True, checkpointing=plan.checkpointing))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap * GIB / total)
    try:
        row.update(train_steps(model, controller, optimizer, packed_batch(plan.tokens or 0, shape.vocab_size, 1), 2))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return row


def report_row(row: dict) -> None:
    print(json.dumps({k: v for k, v in row.items() if k not in ("setup", "reasons", "resolved")}), flush=True)


def flush(args: argparse.Namespace, rows: list[dict]) -> None:
    Path(args.out).write_text(json.dumps({"meta": args.meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


def environment() -> dict[str, Any]:
    import peft
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    try:
        import bitsandbytes

        versions["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        versions["bitsandbytes"] = "not installed"
    return {
        "gpu": props.name,
        "total_gib": round(props.total_memory / GIB, 1),
        "compute_capability": list(torch.cuda.get_device_capability(0)),
        "versions": versions,
        "date": datetime.date.today().isoformat(),
        "python": sys.version.split()[0],
    }


def error_pct(row: dict) -> float | None:
    if row.get("kind") != "accuracy" or "peak_bytes" not in row or row.get("oom"):
        return None
    return 100.0 * (row["predicted_bytes"] - row["peak_bytes"]) / row["peak_bytes"]


def measured_words(rows: list[dict]) -> str:
    """What the measured column holds: the true peak where the rows have one, else (rows measured before it) the
    allocated peak."""
    if any("true_peak_bytes" in row for row in rows):
        return "the true peak, the allocator's peak reserved memory"
    return "`torch.cuda.max_memory_allocated`"


def markdown(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    lines = [
        "# Planner accuracy: predicted vs measured peak training memory",
        "",
        f"GPU: {meta['gpu']} ({meta['total_gib']} GiB), {meta['date']}, "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        "One packed row (documents of 128-2,048 tokens), random-init weights, LoRA r16 on all linear layers, AdamW,",
        "two steps through the engine's loader and speed controller; measured = " + measured_words(rows),
        "(CUDA context not included). QLoRA loads NF4 with double quantization through peft's",
        "`prepare_model_for_kbit_training` (fp32 embeddings, norms, head and activations), as the engine did then;",
        "these rows are predicted with `kbit_upcast=True`. The engine's own preparation (16-bit embeddings, norms,",
        "head and activations; now the planner's default) has not been re-measured here: its 8B QLoRA rows, and",
        "the 8 and 12 GiB planner verdicts below, are stale (see benchmarks/history/long_context_h200.md for 8B QLoRA",
        "measured with it).",
        "",
        "| shape | quant | attention | checkpointing | tokens | predicted GiB | measured GiB | error |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    errors = []
    for row in rows:
        if row.get("kind") != "accuracy":
            continue
        quant = "QLoRA" if row["qlora"] else "LoRA bf16"
        attention = row["attention"] + ("" if row["metadata_cache"] else " (stock)")
        measured = "-"
        err = error_pct(row)
        if row.get("oom"):
            measured = "out of memory"
        elif "peak_bytes" in row:
            measured = f"{row['peak_bytes'] / GIB:.2f}"
        elif "skipped" in row:
            measured = f"not run: {row['skipped']}"
        if err is not None:
            errors.append((abs(err), row))
        lines.append(
            f"| {row['shape']} | {quant} | {attention} | {row['checkpointing']} | {row['tokens']:,} "
            f"| {row['predicted_bytes'] / GIB:.2f} | {measured} | {'' if err is None else f'{err:+.1f}%'} |"
        )
    if errors:
        worst, row = max(errors, key=lambda item: item[0])
        lines += ["", f"Worst error: {worst:.1f}% ({row['shape']}, {row['checkpointing']}, {row['tokens']:,} tokens)."]
    lines += cap_lines(rows)
    return "\n".join(lines) + "\n"


def cap_lines(rows: list[dict]) -> list[str]:
    caps = [row for row in rows if row.get("kind") == "cap"]
    if not caps:
        return []
    lines = [
        "",
        "## Planner-chosen settings under emulated cards (`set_per_process_memory_fraction`)",
        "",
        "The planner plans for the card size less 0.5 GiB of CUDA context and keeps a 10% margin;",
        "runs use `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (without it the allocator fragmented and",
        "several planned configurations ran out of memory with up to 4.9 GiB reserved but unallocated).",
        "",
        "| shape | card GiB | quant | checkpointing | tokens | predicted GiB | measured GiB | result |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for row in caps:
        quant = "QLoRA" if row["qlora"] else "LoRA bf16"
        if not row["fits"]:
            result = "planner: " + row["reasons"].get("fit", "does not fit")
            measured = "-"
        else:
            result = "out of memory" if row.get("oom") else "trained"
            measured = f"{row['peak_bytes'] / GIB:.2f}" if "peak_bytes" in row else "-"
        tokens = f"{row['tokens']:,}" if row["tokens"] else "-"
        if row.get("note"):
            result += f" ({row['note']})"
        lines.append(
            f"| {row['shape']} | {row['cap_gib']} | {quant} | {row['checkpointing']} | {tokens} "
            f"| {row['predicted_bytes'] / GIB:.2f} | {measured} | {result} |"
        )
    return lines


def repredict(data: dict) -> dict:
    """Recompute the predictions with the current planner (the measurements stay as measured)."""
    for row in data["rows"]:
        if row.get("kind") == "accuracy":
            setup = TrainSetup(**row["setup"])
            estimate = estimate_memory(load_shape(row["shape"]), setup, tuple(data["meta"]["compute_capability"]))
            row["predicted_bytes"], row["attention"] = estimate.peak, estimate.attention
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="planner_accuracy.json", help="JSON results (a .md table is written beside)")
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b,llama-3.1-8b:qlora")
    parser.add_argument("--tokens", default="2048,8192,16384")
    parser.add_argument("--modes", default="none,standard,offloaded")
    parser.add_argument("--caps", default="8,12,16,24", help="emulated card sizes in GiB")
    parser.add_argument("--stock", action="store_true", help="also measure with the metadata cache off (LoRA shapes)")
    parser.add_argument("--time-limit", type=float, default=520.0, help="seconds after which no new run starts")
    parser.add_argument("--report", help="re-print (with current predictions) the table of an existing JSON")
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    args.caps = [int(c) for c in args.caps.split(",") if c]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        data = repredict(json.loads(Path(args.report).read_text(encoding="utf-8")))
        Path(args.report).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        Path(args.report).with_suffix(".md").write_text(markdown(data), encoding="utf-8")
        print(markdown(data))
        return 0
    deadline = time.monotonic() + args.time_limit
    args.meta = environment()
    rows: list[dict] = []
    shapes = args.shapes.split(",")
    if len(shapes) == 1:
        name, _, quant = shapes[0].partition(":")
        measure_shape(name, quant == "qlora", args, deadline, rows)
        return 0
    for item in shapes:  # one process per shape: nothing of the previous model stays allocated
        part = Path(args.out).with_suffix(f".{item.replace(':', '-')}.json")
        left = max(0.0, deadline - time.monotonic())
        command = [sys.executable, __file__, "--shapes", item, "--out", str(part), "--time-limit", str(left)]
        command += ["--tokens", ",".join(map(str, args.tokens)), "--modes", ",".join(args.modes)]
        command += ["--caps", ",".join(map(str, args.caps))] + (["--stock"] if args.stock else [])
        subprocess.run(command, check=False)
        if part.exists():
            rows += json.loads(part.read_text(encoding="utf-8"))["rows"]
            part.unlink()
    data = {"meta": args.meta, "rows": rows}
    flush(args, rows)
    Path(args.out).with_suffix(".md").write_text(markdown(data), encoding="utf-8")
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
