"""4-bit 7-8B fine-tuning on a small card: ``tunedeck bench --qlora``.

The workload most people with an 8-24 GB card run: a Llama-3.1-8B or Qwen3-8B shaped model (random init from its
config) in NF4 with double quantization, LoRA r32 on every linear layer, AdamW, one document filling a row of 4,096
or 16,384 tokens, under allocator caps of 8 and 24 GiB (``torch.cuda.set_per_process_memory_fraction``; the CUDA
context is not counted). The model is built on the meta device and quantized layer by layer straight onto the GPU
(:func:`engine.bench.long_context.build_quantized_model`), so no 16-bit copy ever exists there. A MoE shape
(``--models qwen3-30b-a3b``) gets its 3-D experts in NF4 as well (engine.model.quantized_experts) and LoRA on the
attention projections; its ``stock`` variant is skipped with a note, since stock keeps the experts in 16-bit.

Variants, timed one after another in the same process on the same rows:

* ``stock``: transformers + peft + bitsandbytes as documented (``prepare_model_for_kbit_training``, standard
  checkpointing, sdpa, the model's own loss): every TuneDeck switch off, step graphs included;
* ``auto``: TuneDeck with every switch automatic, as ``tunedeck train --qlora`` runs;
* ``auto-X``: automatic with switch X off, which tells what each switch is worth;
* ``auto+X``: automatic with switch X on, for the switches that are off unless switched on or on only in some
  settings (fp8 base matmuls everywhere, step graphs; ``auto+X+Y`` switches on both);
  a ``+foreach_adamw`` tail on any TuneDeck variant updates with the foreach AdamW instead of the fused one;
  a ``+fp8_recompute_only`` tail on an fp8-base variant runs it with ``--fp8-base recompute`` (the forward pass
  in 16 bits, fp8 products only in the offloaded recompute and the input gradients);
  ``auto-whole_row``: the varlen kernel asked for by name, so a one-document row runs through it instead of
  cuDNN's (what cuDNN's kernel is worth).

How a row reads each step's loss and gradient norm: not at all by default (the GPU's work alone); with a
``+read_immediate`` tail (or ``--as-trainer`` for every row) on the host before the update, as ``tunedeck train
--step-readout immediate`` does, so the row includes the GPU's wait on the host between steps; with a
``+read_late`` tail one step late, as ``tunedeck train`` does by default with the fused AdamW
(engine.run.readout).

Losses: 20 steps of ``auto`` (and of each ``auto+X``) on fresh rows against the same 20 steps of the
float32-LoRA ``stock`` path, from the same base and adapter initialisation. Each row gives the planner's predicted
peak beside the measured one: the true peak (the allocator's peak reserved memory, step graphs' pool included;
engine.hardware.vram) and the allocated peak.

    tunedeck bench --qlora --out benchmarks/qlora_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.bench import write_report
from engine.bench.speed import (
    LateReadout,
    bench_adamw,
    graphs_decided,
    log_row,
    time_steps,
    timing_turn,
    train_step,
    true_peak_gib,
)
from engine.bench.step_profile import CATEGORIES, profile_step
from engine.config import SpeedConfig
from engine.hardware.shapes import BUILTIN_CONFIGS

GIB = 1 << 30
LORA_RANK = 32
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(BUILTIN_CONFIGS["llama-3.1-8b"], max_position_embeddings=131072, rope_theta=500000.0),
    "qwen3-8b": dict(BUILTIN_CONFIGS["qwen3-8b"], max_position_embeddings=40960, rope_theta=1000000.0),
    "qwen3-30b-a3b": dict(BUILTIN_CONFIGS["qwen3-30b-a3b"], max_position_embeddings=40960, rope_theta=1000000.0),
}
STOCK_SKIPPED = (
    "stock skipped: transformers + bitsandbytes keep the 3-D MoE experts in 16-bit (~54 GiB for Qwen3-30B-A3B), "
    "which cannot fit the cap"
)
AUTO = SpeedConfig()
STOCK = SpeedConfig.stock(checkpointing="standard")
"""peft's documented QLoRA: standard checkpointing and every TuneDeck switch off, step graphs included (left
automatic, they went on trial in the stock rows)."""
ABLATED = (
    "fused_kernels", "dequant_once", "host_embedding", "fused_loss", "metadata_cache", "step_graphs", "resident_layers",
    "fp8_base",
)  # fmt: skip
"""Switches whose worth ``auto-X`` measures (each turned off alone)."""
WHOLE_ROW = "whole_row"
"""``auto-whole_row``: the varlen kernel asked for by name, so a one-document row takes neither cuDNN's kernel nor
SDPA's causal path (engine.speed.metadata_cache.PackedAttentionMetadata.whole_row_causal)."""


SWITCHED_ON: dict[str, Any] = {"fp8_base": "all", "step_graphs": True}
"""Switches off unless switched on, whose worth ``auto+X`` measures (X switched on over the automatic choices), and
the value that switches each on (fp8 everywhere)."""
FOREACH_ADAMW = "foreach_adamw"
"""A bench knob as a variant's ``+foreach_adamw`` tail: the row's AdamW is the foreach one, not the fused one
(engine.run.optimizer), to measure both."""
READ_IMMEDIATE, READ_LATE = "read_immediate", "read_late"
"""Bench knobs as a variant's tail: each step's values read on the host before the update, or one step late."""
FP8_RECOMPUTE_ONLY = "fp8_recompute_only"
"""A tail on an fp8-base variant: ``--fp8-base recompute``, the forward pass (the loss) stays in 16 bits, fp8
products only in the offloaded recompute and the input gradients."""
TAILS = (FOREACH_ADAMW, READ_IMMEDIATE, READ_LATE, FP8_RECOMPUTE_ONLY)
RESIDENT = "auto-resident="
"""``auto-resident=N``: automatic, with exactly N layers resident (not the count the planner fits)."""


def resident_of(variant: str) -> int | None:
    return int(variant.removeprefix(RESIDENT)) if variant.startswith(RESIDENT) else None


def split_tails(variant: str) -> tuple[str, set[str]]:
    """A variant without its bench-knob tails (``+foreach_adamw``, ``+read_immediate``, ``+read_late``), and them."""
    tails: set[str] = set()
    while any(variant.endswith(f"+{tail}") for tail in TAILS):
        base, tail = variant.rsplit("+", 1)
        variant = base
        tails.add(tail)
    return variant, tails


def optimizer_choice(variant: str) -> str:
    """The ``--adamw`` choice of a variant's rows."""
    return "foreach" if FOREACH_ADAMW in split_tails(variant)[1] else "auto"


def step_function(
    variant: str, as_trainer: bool, model: Any, controller: Any, optimizer: Any
) -> Callable[..., torch.Tensor]:
    """``step(batch)`` for a variant's rows, reading each step's values as its tail (or ``--as-trainer``) says."""
    tails = split_tails(variant)[1]
    if READ_LATE in tails:
        return LateReadout(model, controller, optimizer)
    immediate = as_trainer or READ_IMMEDIATE in tails
    return functools.partial(train_step, model, controller, optimizer=optimizer, as_trainer=immediate)


def variant_settings(variant: str) -> SpeedConfig:
    variant, tails = split_tails(variant)
    if {FOREACH_ADAMW, READ_LATE} <= tails:
        raise ValueError(f"variant {variant!r}: +read_late needs the fused AdamW (it skips bad steps on the GPU)")
    settings = _switch_settings(variant)
    return dataclasses.replace(settings, fp8_base="recompute") if FP8_RECOMPUTE_ONLY in tails else settings


def _switch_settings(variant: str) -> SpeedConfig:
    if variant == "stock":
        return STOCK
    if variant == "auto":
        return AUTO
    if variant.startswith(RESIDENT):
        return dataclasses.replace(AUTO, resident_layers=True)
    if variant.startswith("auto+"):
        switches = variant.removeprefix("auto+").split("+")
        unknown = [s for s in switches if s not in SWITCHED_ON]
        if unknown:
            raise ValueError(f"unknown variant {variant!r}: auto+SWITCH[+SWITCH] takes SWITCH in {tuple(SWITCHED_ON)}")
        switched_on: dict[str, Any] = {switch: SWITCHED_ON[switch] for switch in switches}
        return dataclasses.replace(AUTO, **switched_on)
    switch = variant.removeprefix("auto-")
    if switch == WHOLE_ROW:
        return dataclasses.replace(AUTO, attention_backend="varlen")
    if switch not in ABLATED:
        raise ValueError(f"unknown variant {variant!r}: stock, auto or auto-SWITCH with SWITCH in {ABLATED}")
    switched_off: dict[str, Any] = {switch: "off" if switch == "fp8_base" else False}
    return dataclasses.replace(AUTO, **switched_off)


def set_variant(controller: Any, variant: str) -> None:
    """Apply ``variant``'s switches (its tails' too) and the bench's own knob (a fixed number of resident
    layers)."""
    controller.resident_override = resident_of(split_tails(variant)[0])
    controller.apply(variant_settings(variant))


def model_config(name: str) -> Any:
    from transformers import AutoConfig

    settings = dict(SHAPES[name])
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def build(name: str, stock: bool, device: torch.device) -> Any:
    """The quantized model with LoRA r32: TuneDeck's preparation, or peft's for ``stock``."""
    from engine.bench.long_context import build_quantized_model, with_lora

    torch.manual_seed(0)
    model = with_lora(build_quantized_model(model_config(name), device), "stock" if stock else "tunedeck")
    model.train()
    return model


def rows_of(tokens: int, vocab: int, count: int, seed: int = 0) -> list[Any]:
    from engine.bench.long_context import one_document

    return [one_document(tokens, vocab, seed=seed + i) for i in range(count)]


def cap_memory(cap_gib: float | None, device: torch.device) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (cap_gib or 1e9) * GIB / total), device)


def measure(
    step: Callable[[], object], warmup: int, steps: int, settled: Callable[[], bool] = lambda: True
) -> dict[str, Any]:
    """:func:`engine.bench.speed.time_steps` with the true peak under this report's key (``peak_gib``; the allocated
    peak is ``allocated_peak_gib``); only the warm-up when ``steps`` is 0 (the compile pass)."""
    if steps:
        result = time_steps(step, warmup, steps, settled)
        result["peak_gib"] = result.pop("peak_vram_gib")
        return result
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    return {"warmup_s": time.perf_counter() - start}


def planned_peak_gib(name: str, state: dict[str, Any], tokens: int) -> float | None:
    from engine.hardware.planner import state_peak_bytes
    from engine.hardware.shapes import ModelShape

    try:
        shape = ModelShape.from_config_dict(SHAPES[name], name)
        return state_peak_bytes(shape, state, tokens, qlora=True, lora_rank=LORA_RANK) / GIB
    except (KeyError, ValueError, TypeError):
        return None


@dataclasses.dataclass
class Subject:
    """One built model and the one speed controller that switches it between variants (as a user flips switches
    in a running job: compiled graphs are kept and reused)."""

    name: str
    model: Any
    controller: Any


def subject(name: str, stock: bool, device: torch.device) -> Subject:
    from engine.speed import SpeedController

    model = build(name, stock, device)
    return Subject(name, model, SpeedController(model, STOCK, device))


def run_variant(
    who: Subject, variant: str, tokens: int, cap: float, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """One timed row (only the warm-up when ``args.steps`` is 0); out of memory is a row too, never an abort."""
    model, controller = who.model, who.controller
    row: dict[str, Any] = {"model": who.name, "variant": variant, "tokens": tokens, "cap_gib": cap, "ok": False}
    optimizer = bench_adamw(model, 1e-5, optimizer_choice(variant))
    step = step_function(variant, args.as_trainer, model, controller, optimizer)
    try:
        cap_memory(cap, device)
        set_variant(controller, variant)  # automatic choices see the cap
        batch = rows_of(tokens, model.config.vocab_size, 1)[0].to(device)
        decided = functools.partial(graphs_decided, controller)  # no timed step runs the step graphs' trial
        row.update(measure(lambda: step(batch=batch), args.warmup, args.steps, decided))
        row["state"] = controller.state()
        if args.steps and args.profile_dir is not None:
            label = f"{who.name}_{tokens}_{cap:g}gib_{variant}".replace("=", "").replace("+", "_with_")
            row["profile"] = profile_step(lambda: step(batch=batch), args.profile_dir, label)
        if args.steps:
            row["planned_peak_gib"] = planned_peak_gib(who.name, row["state"], tokens)
            row["tokens_per_s"] = tokens / row["ms_per_step"] * 1e3
        row["ok"] = True
    except (torch.OutOfMemoryError, RuntimeError) as err:
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        cap_memory(None, device)
        set_variant(controller, "stock")  # the stand-ins and hooks come off; compiled graphs stay cached
    if args.steps:
        print(_line(row), flush=True)
        log_row(row, args.rows_log)
    return row


def losses(who: Subject, variant: str, args: argparse.Namespace, device: torch.device) -> list[float]:
    """``args.loss_steps`` steps on fresh rows from the adapter's initial weights (restored afterwards). TuneDeck's
    variants train under the first cap, so their automatic choices (checkpointing among them) are the timed
    rows'; stock trains uncapped (under a small cap it runs out of memory)."""
    model, controller = who.model, who.controller
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = bench_adamw(model, 1e-4, optimizer_choice(variant))
    cap_memory(None if variant == "stock" else args.caps[0], device)
    try:
        set_variant(controller, variant)
        out = []
        for batch in rows_of(args.loss_tokens, model.config.vocab_size, args.loss_steps, seed=1000):
            out.append(float(train_step(model, controller, batch.to(device), optimizer)))
    finally:
        cap_memory(None, device)
        set_variant(controller, "stock")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in start:
                p.copy_(start[n])
    return out


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    tuned = subject(name, stock=False, device=device)
    from engine.model.quantized_experts import experts_notice

    experts = experts_notice(tuned.model)
    if experts is not None:
        print(f"{name}: {experts}", flush=True)
    cases = [(t, c) for t in args.tokens for c in args.caps]
    ours = [v for v in args.variants if v != "stock"]
    compile_pass = argparse.Namespace(**{**vars(args), "steps": 0})
    for variant in ours:  # compile every graph first, untimed (peers compile side by side)
        run_variant(tuned, variant, *cases[0], compile_pass, device)
    rows = []
    with timing_turn(args.timing_lock, args.peers, name):
        for tokens, cap in cases:
            for variant in ours:
                if variant == "auto" or variant.startswith("auto+") or (tokens, cap) == cases[0]:
                    rows.append(run_variant(tuned, variant, tokens, cap, args, device))
        compared = [v for v in ours if v == "auto" or v.startswith("auto+")]
        ours_losses = {v: losses(tuned, v, args, device) for v in compared} if args.loss_steps else {}
        del tuned
        gc.collect()
        torch.cuda.empty_cache()
        stock_losses: list[float] = []
        notes = [STOCK_SKIPPED] if "stock" in args.variants and is_moe(name) else []
        for note in notes:
            print(f"{name}: {note}", flush=True)
        if "stock" in args.variants and not notes:
            stock = subject(name, stock=True, device=device)
            rows += [run_variant(stock, "stock", tokens, cap, args, device) for tokens, cap in cases]
            stock_losses = losses(stock, "stock", args, device) if args.loss_steps else []
            del stock
    return {"model": name, "rows": rows, "losses": {**ours_losses, "stock": stock_losses}, "notes": notes}


def is_moe(name: str) -> bool:
    return bool(SHAPES[name].get("num_experts"))


def loss_agreement(record: dict[str, Any], variant: str = "auto", reference: str = "stock") -> float | None:
    """Largest relative difference between ``variant``'s and ``reference``'s per-step losses (by default the
    float32-LoRA stock path's)."""
    found, expected = record["losses"].get(variant, []), record["losses"].get(reference, [])
    if not found or len(found) != len(expected):
        return None
    worst: float = max(abs(a - s) / abs(s) for a, s in zip(found, expected, strict=True))
    return worst


def _number(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or "-" where there is none (not run, or measured before it was recorded)."""
    return format(value, spec) if value is not None else "-"


def _line(row: dict[str, Any]) -> str:
    if not row["ok"]:
        return f"{row['model']} {row['variant']} {row['tokens']} tokens cap {row['cap_gib']:g}: {row.get('error')}"
    return (f"{row['model']} {row['variant']} {row['tokens']} tokens cap {row['cap_gib']:g}: "
            f"{row['ms_per_step']:.0f} ms/step, {row.get('tokens_per_s', 0):,.0f} tok/s, peak {row['peak_gib']:.2f} "
            f"GiB reserved, {row.get('allocated_peak_gib', 0):.2f} GiB allocated, {row['syncs']} syncs")  # fmt: skip


def _trainer_lines(report: dict[str, Any]) -> list[str]:
    if str(report.get("settings", {}).get("as_trainer")) != "True":
        return []
    return [
        "Timed as `tunedeck train --step-readout immediate` runs (`--as-trainer`): each step's loss and gradient norm",
        "are read on the host before the update (2 host syncs a step, in the syncs column), so the GPU's wait between",
        "steps is included.",
    ]


def markdown(report: dict[str, Any]) -> str:
    from engine.bench.long_context import environment, environment_line

    meta = report.get("environment") or environment()
    lines = [
        "# QLoRA: 4-bit 8B fine-tuning, stock against TuneDeck",
        "",
        environment_line(meta),
        "",
        "Random-init Llama-3.1-8B and Qwen3-8B shapes in NF4 with double quantization, LoRA r32 on all linear",
        "layers (Qwen3-30B-A3B: experts in NF4 too, LoRA r32 on the attention projections), AdamW, batch size 1,",
        "one document filling the row, allocator capped with `set_per_process_memory_fraction` (the CUDA context is",
        "not counted). `stock` = transformers + peft + bitsandbytes (`prepare_model_for_kbit_training`, standard",
        "checkpointing, sdpa; every TuneDeck switch off, step graphs included); `auto` = TuneDeck with every switch",
        "automatic; `auto-X` = automatic with X off;",
        "`auto+X` = automatic with X switched on (fp8_base: frozen-weight products in fp8; step_graphs: each",
        "micro-batch replayed from a CUDA graph; `auto+X+Y`: both; a `+foreach_adamw` tail: the foreach AdamW",
        "instead of the fused one; "
        "`+read_immediate` / `+read_late` tails: each step's loss and gradient norm read on the host before the "
        "update / one step late, as `tunedeck train` does);",
        "`auto-resident=N` = automatic with exactly N layers resident (`auto` sizes that count to the memory).",
        "Median of the",
        "timed steps after warm-up (compiles done, automatic step graphs' trial decided). Host ms: how long the host",
        "took to queue a step (close to ms/step: the host's Python and launch overhead, not the GPU, sets the",
        "pace). Peak GiB (reserved): the true peak, the allocator's peak reserved memory over the timed steps,",
        "which includes step graphs' memory pool (its blocks are not allocated between replays); allocated GiB: live",
        "tensors only (what the peak column showed before the true peak, and undercounts rows with step graphs).",
        *_trainer_lines(report),
        "",
        "| model | tokens | cap GiB | variant | ms/step | host ms | tokens/s | x stock | peak GiB (reserved) "
        "| allocated GiB | planned GiB | syncs |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for record in report["models"]:
        for row in record["rows"]:
            lines.append(_table_row(row, record["rows"]))
    lines += [
        "",
        "| model | variant | loss steps | max relative difference vs float32-LoRA stock | vs auto |",
        "|---|---|---:|---:|---:|",
    ]
    for record in report["models"]:
        for variant in (v for v in record["losses"] if v != "stock"):
            agreement = _number(loss_agreement(record, variant), ".2e")
            with_auto = _number(loss_agreement(record, variant, "auto"), ".2e") if variant != "auto" else "-"
            steps = len(record["losses"][variant])
            lines.append(f"| {record['model']} | {variant} | {steps} | {agreement} | {with_auto} |")
    lines += profile_lines(report)
    lines += ["", *report.get("notes", []), *(note for record in report["models"] for note in record.get("notes", []))]
    return "\n".join(lines) + "\n"


def profile_lines(report: dict[str, Any]) -> list[str]:
    """The profiled rows (``--profile-dir``): GPU time by kernel kind and busy time, against the step and the
    host's time to queue it (engine.bench.step_profile)."""
    rows = [row for record in report["models"] for row in record["rows"] if row.get("profile")]
    if not rows:
        return []
    kinds = " | ".join(CATEGORIES)
    lines = [
        "",
        "One profiled step per row, in ms: GPU time by kernel kind, the time the GPU was busy at all (copies run",
        "beside the kernels), the host's time to queue a step and its operators' own time.",
        "",
        f"| model | tokens | cap GiB | variant | ms/step | host ms | GPU busy | {kinds} | host ops |",
        "|---|---:|---:|---|" + "---:|" * (4 + len(CATEGORIES)),
    ]
    for row in rows:
        profile = row["profile"]
        gpu = " | ".join(f"{profile['gpu_ms'].get(kind, 0.0):.0f}" for kind in CATEGORIES)
        host = _number(row.get("host_ms"), ".0f")
        lines.append(
            f"| {row['model']} | {row['tokens']:,} | {row['cap_gib']:g} | {row['variant']} | {row['ms_per_step']:.0f} "
            f"| {host} | {profile['gpu_busy_ms']:.0f} | {gpu} | {profile['host_self_ms']:.0f} |"
        )
    return lines


def _table_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = f"| {row['model']} | {row['tokens']:,} | {row['cap_gib']:g} | {row['variant']} "
    if not row["ok"]:
        return (
            head + "| out of memory | - | - | - | - | - | - | - |"
            if "memory" in row.get("error", "")
            else (head + f"| {row.get('error', 'failed')[:60]} | - | - | - | - | - | - | - |")
        )
    stock = next((r for r in rows if r["variant"] == "stock" and r["tokens"] == row["tokens"]
                  and r["cap_gib"] == row["cap_gib"] and r["ok"]), None)  # fmt: skip
    ratio = f"{stock['ms_per_step'] / row['ms_per_step']:.2f}" if stock else "-"
    planned = _number(row.get("planned_peak_gib") or None, ".2f")
    host, true_peak = _number(row.get("host_ms"), ".0f"), _number(true_peak_gib(row), ".2f")
    allocated = _number(row.get("allocated_peak_gib", row["peak_gib"]), ".2f")
    return (head + f"| {row['ms_per_step']:.0f} | {host} | {row['tokens_per_s']:,.0f} | {ratio} "
            f"| {true_peak} | {allocated} | {planned} | {row['syncs']} |")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tunedeck bench --qlora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3.1-8b,qwen3-8b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="4096,16384", help="row lengths")
    parser.add_argument("--caps", default="8,24", help="allocator caps in GiB")
    switched_on = ["auto+fp8_base", "auto+step_graphs", "auto+fp8_base+step_graphs"]
    default_variants = ",".join(["stock", "auto", *(f"auto-{s}" for s in (*ABLATED, WHOLE_ROW)), *switched_on])
    parser.add_argument("--variants", default=default_variants, help="stock, auto, auto-SWITCH, auto+SWITCH")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row")
    parser.add_argument(
        "--as-trainer",
        action="store_true",
        help="read each step's loss and gradient norm on the host before the update, as tunedeck train does",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    parser.add_argument("--loss-steps", type=int, default=20, help="steps of the loss comparison (0: none)")
    parser.add_argument("--loss-tokens", type=int, default=4096, help="row length of the loss comparison")
    parser.add_argument("--timing-lock", type=Path, help="a lock file shared by bench processes on one GPU")
    parser.add_argument("--peers", type=int, default=1, help="processes sharing --timing-lock")
    parser.add_argument("--rows-log", type=Path, help="append each row as a JSON line (kept if cut short)")
    parser.add_argument(
        "--profile-dir", type=Path, help="profile one step of each row: GPU time by kernel kind, host operators"
    )
    parser.add_argument("--merge", nargs="*", type=Path, help="build the report from JSON files of model records")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/qlora.json"), help="JSON (+ .md beside)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.caps = [float(c) for c in args.caps.split(",") if c]
    args.variants = [v for v in args.variants.split(",") if v]
    for variant in args.variants:
        variant_settings(variant)
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: {', '.join(SHAPES)}")
    return args


def write(report: dict[str, Any], out: Path) -> None:
    write_report(report, out, markdown(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        from engine.bench.long_context import environment

        records = [json.loads(path.read_text(encoding="utf-8")) for path in args.merge]
        report: dict[str, Any] = {
            "environment": records[0].get("environment") or environment(),
            "models": [m for r in records for m in r["models"]],
            "notes": [n for r in records for n in r.get("notes", [])],
        }
        write(report, args.out)
        return 0
    if not torch.cuda.is_available():
        print("tunedeck bench --qlora needs an NVIDIA GPU (torch sees none)", file=sys.stderr)
        return 2
    from engine.bench.long_context import environment

    report = {"environment": environment(), "settings": {k: str(v) for k, v in vars(args).items()}}
    report["models"] = [bench_model(name, args) for name in args.models]
    write(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
