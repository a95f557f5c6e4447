"""The longest row an 8B QLoRA run trains on a small card: ``tunedeck bench --long-context``.

A Llama-3.1-8B-shaped model (random init from its config; vocab 128,256, hidden 4,096, 32 layers, 32 heads, 8 KV
heads, MLP 14,336) is quantized to NF4 layer by layer straight onto the GPU, so no 16 GB of 16-bit weights ever
exist there (an 8 GiB cap holds the whole build), and gets LoRA r32 on every linear layer. A probe trains two
full AdamW steps on one document that fills a row of N tokens (batch size 1) under an allocator cap
(``torch.cuda.set_per_process_memory_fraction``; the CUDA context, about 0.5 GiB on a real card, is not counted),
each in a fresh process: a process that ran out of memory keeps a fragmented cache and compiled kernels.
The search doubles N until a probe fails, then bisects to the requested resolution.

Variants: ``tunedeck`` (every memory switch on: QLoRA without the float32 upcast, offloaded checkpointing, fused
loss, chunked per-token modules, the input embedding in host memory, metadata cache with varlen attention) and
``stock`` (transformers + peft as documented: ``prepare_model_for_kbit_training``, standard checkpointing, sdpa,
the model's own loss; every TuneDeck switch off, step graphs included). A probe's peak is the true peak (the
allocator's peak reserved memory, engine.hardware.vram), with the allocated peak beside it.

    tunedeck bench --long-context --caps 8,16,24 --out benchmarks/long_context_h200.json
    tunedeck bench --long-context --smoke 4096,16384   # memory per phase, uncapped, in one process
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.bench import write_report
from engine.hardware.shapes import BUILTIN_CONFIGS
from engine.hardware.vram import read_step_peak, reset_step_peak

GIB = 1 << 30
LLAMA_8B: dict[str, Any] = dict(
    BUILTIN_CONFIGS["llama-3.1-8b"], max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5
)
LORA_RANK = 32
ROUND_TOKENS = 256
"""Probed lengths are multiples of 256 tokens."""
TARGETS = {8: 14000, 16: 54000, 24: 95000}
"""Issue 9's targets (tokens) per cap in GiB; a peer reaches 7.7k, 41k and 73k."""


# --- the search (pure) ------------------------------------------------------------------------------------------


@dataclass
class SearchResult:
    """The longest length that passed, the shortest that failed, and every probe in order."""

    longest: int | None
    shortest_failure: int | None
    probes: list[tuple[int, bool]] = field(default_factory=list)
    stopped: str = ""

    @property
    def resolution(self) -> int | None:
        if self.longest is None or self.shortest_failure is None:
            return None
        return self.shortest_failure - self.longest


def _round(tokens: float) -> int:
    return max(ROUND_TOKENS, int(tokens) // ROUND_TOKENS * ROUND_TOKENS)


def longest_passing(
    probe: Callable[[int], bool | None],
    start: int,
    *,
    resolution: int = 2048,
    ceiling: int = 262144,
    floor: int = 512,
    growth: float = 2.0,
) -> SearchResult:
    """Grow from ``start`` by ``growth`` until a probe fails (shrinking instead if ``start`` fails), then bisect.

    ``probe(tokens)`` says whether that row trains; None means it could not run (out of time), which ends the
    search with what is known. Memory grows with length, so one failure bounds everything above it.
    """
    result = SearchResult(None, None)

    def run(tokens: int) -> bool | None:
        ok = probe(tokens)
        if ok is not None:
            result.probes.append((tokens, ok))
            if ok:
                result.longest = max(result.longest or 0, tokens)
            else:
                result.shortest_failure = min(result.shortest_failure or tokens, tokens)
        return ok

    tokens = _round(start)
    while True:  # exponential phase
        ok = run(tokens)
        if ok is None:
            result.stopped = "time limit"
            return result
        if ok and tokens >= ceiling:
            result.stopped = "ceiling"
            return result
        if ok and result.shortest_failure is None:
            tokens = min(ceiling, _round(tokens * growth))
        elif not ok and result.longest is None:
            if tokens <= floor:
                result.stopped = "even the shortest row fails"
                return result
            tokens = max(floor, _round(tokens / growth))
        else:
            break
    while result.resolution is not None and result.resolution > resolution:  # binary phase
        assert result.longest is not None and result.shortest_failure is not None
        mid = _round((result.longest + result.shortest_failure) / 2)
        if mid <= result.longest:
            break
        if run(mid) is None:
            result.stopped = "time limit"
            return result
    result.stopped = result.stopped or "resolution reached"
    return result


# --- building the model under the cap ---------------------------------------------------------------------------


def llama_8b_config(**overrides: Any) -> Any:
    from transformers import AutoConfig

    settings = dict(LLAMA_8B)
    settings.update(overrides)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def _quantized_linear(linear: torch.nn.Linear, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Any:
    """A bitsandbytes NF4 layer with random weights, quantized on ``device`` from one 16-bit weight at a time."""
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=False, compute_dtype=dtype, quant_type="nf4", device="meta"
    )
    weight = torch.empty(linear.out_features, linear.in_features, device=device, dtype=dtype)
    weight.normal_(0.0, 0.02, generator=gen)
    param = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4", module=layer)
    layer.weight = param.to(device)  # type: ignore[misc]  # bitsandbytes types .to()'s self as a Module
    return layer


def _quantize_random_experts(model: Any, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Every MoE layer's experts drawn on ``device`` and quantized to NF4 before the next layer's are drawn."""
    from engine.model.quantized_experts import expert_weight_names, experts_modules, quantize_experts

    for parent, attribute, experts in experts_modules(model):
        weights = {}
        for name in expert_weight_names(experts):
            shape = experts._parameters[name].shape  # type: ignore[union-attr]
            weights[name] = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        parent._modules[attribute] = quantize_experts(experts, weights)
        del weights


def build_quantized_model(config: Any, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Any:
    """A random-init causal LM whose decoder linears and MoE experts are NF4, built without ever holding its 16-bit
    weights.

    The skeleton is made on the meta device; each decoder linear, and each MoE layer's 3-D experts, is then drawn in
    16-bit on ``device`` and quantized before the next one is drawn (engine.model.quantized_experts); embeddings,
    norms, routers and the head are drawn in ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    decoder = model.get_decoder()
    for module in list(decoder.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                module._modules[child_name] = _quantized_linear(child, device, dtype, gen)
    _quantize_random_experts(model, device, dtype, gen)
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        value = torch.empty(param.shape, device=device, dtype=dtype)
        value.fill_(1.0) if "norm" in name else value.normal_(0.0, 0.02, generator=gen)
        owner = model.get_submodule(name.rpartition(".")[0])
        owner._parameters[name.rpartition(".")[2]] = torch.nn.Parameter(value, requires_grad=False)
    with torch.device(device):  # its inverse frequencies were computed on the meta device
        decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
    model.config.use_cache = False
    return model


# --- one probe ----------------------------------------------------------------------------------------------------


MEMORY_SWITCHES = ("metadata_cache", "fused_loss", "chunked_mlp", "host_embedding", "lora_16bit")
"""The switches the tunedeck variant turns on; the others (fused kernels, dequantize-once, fp8 products) are
left automatic, as a run sets them."""


def speed_settings(variant: str) -> Any:
    """Every memory switch on, the others automatic (tunedeck); or transformers' own paths with standard
    checkpointing and every switch off, step graphs included (stock)."""
    from engine.config import SpeedConfig

    if variant != "tunedeck":
        return SpeedConfig.stock(checkpointing="standard")
    return SpeedConfig(checkpointing="offloaded", **dict.fromkeys(MEMORY_SWITCHES, True))  # type: ignore[arg-type]


def with_lora(model: Any, variant: str) -> Any:
    from engine.config import LoraConfig
    from engine.model.load import add_lora

    lora = LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK)
    if variant == "tunedeck":
        return add_lora(model, lora, qlora=True)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = PeftLoraConfig(
        r=lora.sized().rank,
        lora_alpha=lora.sized().alpha,  # type: ignore[arg-type]  # peft annotates int; a float alpha works
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def one_document(tokens: int, vocab: int, seed: int = 0) -> Any:
    """One document filling the row; every position but the first is trained."""
    from engine.data.packing import IGNORE_INDEX, TokenizedExample, collate

    gen = torch.Generator().manual_seed(seed)
    ids = tuple(torch.randint(0, vocab, (tokens,), generator=gen).tolist())
    return collate([TokenizedExample(ids, (IGNORE_INDEX, *ids[1:]))])


def _mem(device: torch.device) -> dict[str, float]:
    """A phase's memory: ``peak_gib`` and ``true_peak_gib`` the true peak since the phase began (the reserved peak:
    engine.hardware.vram), ``allocated_peak_gib`` live tensors' peak (what ``peak_gib`` held before the true
    peak), ``allocated_gib`` live tensors at its end."""
    peak = read_step_peak(device, driver=False)
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "peak_gib": peak.true_peak / GIB,
        "true_peak_gib": peak.true_peak / GIB,
        "allocated_peak_gib": peak.allocated / GIB,
        "reserved_gib": peak.reserved / GIB,
    }


def train_steps(model: Any, controller: Any, batch: Any, steps: int, device: torch.device) -> list[dict[str, Any]]:
    """Full AdamW steps on one row; memory and time per phase of each step."""
    from engine.bench.speed import bench_adamw

    optimizer = bench_adamw(model, 1e-4)
    on_device = batch.to(device)
    out = []
    for _ in range(steps):
        row: dict[str, Any] = {}
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        reset_step_peak(device)
        inputs = controller.model_inputs(on_device)
        loss = controller.loss(model, inputs, on_device.labels, on_device.trained_tokens)
        row["forward"] = _mem(device)
        reset_step_peak(device)
        loss.backward()
        row["backward"] = _mem(device)
        reset_step_peak(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        row["optimizer"] = _mem(device)
        torch.cuda.synchronize(device)
        row["loss"] = float(loss.detach())
        row["seconds"] = time.perf_counter() - start
        out.append(row)
        del loss, inputs
    return out


def planned_peak_gib(state: dict[str, Any], tokens: int) -> float:
    """The memory planner's prediction for a probe, from the switches it ran with."""
    from engine.hardware.planner import state_peak_bytes
    from engine.hardware.shapes import ModelShape

    shape = ModelShape.from_config_dict(LLAMA_8B, "llama-3.1-8b")
    return state_peak_bytes(shape, state, tokens, qlora=True, lora_rank=LORA_RANK) / GIB


def probe(tokens: int, cap_gib: float | None, variant: str, steps: int = 2) -> dict[str, Any]:
    """Build, then train ``steps`` steps on a ``tokens``-token row under the cap; never raises for out of memory."""
    from engine.speed import SpeedController

    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
    result: dict[str, Any] = {"tokens": tokens, "cap_gib": cap_gib, "variant": variant, "ok": False}
    try:
        start = time.perf_counter()
        config = llama_8b_config()
        model = with_lora(build_quantized_model(config, device), variant)
        model.train()
        result["build_s"] = time.perf_counter() - start
        result["model_gib"] = torch.cuda.memory_allocated(device) / GIB
        controller = SpeedController(model, speed_settings(variant), device)
        result["steps"] = train_steps(model, controller, one_document(tokens, config.vocab_size), steps, device)
        result["state"] = controller.state()
        result["planned_peak_gib"] = planned_peak_gib(result["state"], tokens)
        result["ok"] = True
    except torch.OutOfMemoryError as err:
        result["error"] = "out of memory: " + str(err).splitlines()[0][:160]
    except RuntimeError as err:  # bitsandbytes and cuBLAS report some allocation failures as plain errors
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    peak = read_step_peak(device, driver=False)  # a failed probe: its last phase's
    result.update(peak_gib=peak.true_peak / GIB, true_peak_gib=peak.true_peak / GIB)
    result["allocated_peak_gib"] = peak.allocated / GIB
    return result


# --- driving fresh processes ---------------------------------------------------------------------------------------


def probe_in_fresh_process(tokens: int, cap_gib: float, variant: str, timeout: float) -> dict[str, Any] | None:
    """Run :func:`probe` in a new interpreter; None when it did not finish within ``timeout`` seconds."""
    command = [sys.executable, "-m", "engine.bench.long_context", "--probe", str(tokens), "--caps", str(cap_gib)]
    command += ["--variant", variant]
    # without expandable segments the allocator fragmented and 8B runs failed with GiBs reserved but unallocated
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            row: dict[str, Any] = json.loads(line)
            return row
    return {"tokens": tokens, "cap_gib": cap_gib, "variant": variant, "ok": False, "error": done.stderr[-400:]}


def search_cap(cap: float, variant: str, start: int, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    records: list[dict[str, Any]] = []

    def attempt(tokens: int) -> bool | None:
        left = deadline - time.monotonic()
        if left < args.min_probe_s:
            return None
        record = probe_in_fresh_process(tokens, cap, variant, left)
        if record is None:
            return None
        records.append(record)
        print(json.dumps(summary(record)), flush=True)
        return bool(record["ok"])

    found = longest_passing(attempt, start, resolution=args.resolution, growth=args.growth)
    return {
        "cap_gib": cap, "variant": variant, "start": start, "longest": found.longest,
        "shortest_failure": found.shortest_failure, "resolution": found.resolution, "stopped": found.stopped,
        "target": TARGETS.get(int(cap)) if variant == "tunedeck" else None, "probes": records,
    }  # fmt: skip


def peak_gib(record: dict[str, Any]) -> float:
    """The highest true peak over every phase of every step (a failed probe: its last phase's). Probes from before
    the true peak held the allocated peak under ``peak_gib`` and the same measure as the true peak under
    ``reserved_gib``, which is read where there is one."""
    phases = [_true_peak(step[k]) for step in record.get("steps") or [] for k in ("forward", "backward", "optimizer")]
    return max(phases, default=_true_peak(record) if "peak_gib" in record else 0.0)


def _true_peak(memory: dict[str, Any]) -> float:
    return float(memory.get("true_peak_gib", memory.get("reserved_gib", memory["peak_gib"])))


def summary(record: dict[str, Any]) -> dict[str, Any]:
    steps = record.get("steps") or []
    return {
        "cap_gib": record.get("cap_gib"), "variant": record.get("variant"), "tokens": record.get("tokens"),
        "ok": record.get("ok"), "peak_gib": round(peak_gib(record), 2),
        "step_s": [round(s["seconds"], 1) for s in steps], "error": record.get("error", "")[:120],
    }  # fmt: skip


def run_searches(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One search per (variant, cap), all in parallel threads; each probe is its own process."""
    deadline = time.monotonic() + args.time_limit
    jobs = [
        (variant, cap, start) for variant in args.variants for cap, start in zip(args.caps, args.starts, strict=True)
    ]
    results: list[dict[str, Any]] = [{} for _ in jobs]

    def work(i: int, variant: str, cap: float, start: int) -> None:
        results[i] = search_cap(cap, variant, start, args, deadline)

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def grid_over_lengths(lengths: list[int], cap: float, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Probe several lengths at once, each in its own fresh process under the same cap (when device time is
    too short for a sequential search); reported like a search whose bracket is the grid's."""
    deadline = time.monotonic() + args.time_limit
    records: list[dict[str, Any] | None] = [None] * len(lengths)

    def work(i: int, tokens: int) -> None:
        records[i] = probe_in_fresh_process(tokens, cap, variant, max(1.0, deadline - time.monotonic()))

    threads = [threading.Thread(target=work, args=(i, t)) for i, t in enumerate(lengths)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [r for r in records if r is not None]
    for record in done:
        print(json.dumps(summary(record)), flush=True)
    passed = [r["tokens"] for r in done if r["ok"]]
    failed = [r["tokens"] for r in done if not r["ok"] and r["tokens"] > max(passed, default=0)]
    longest, shortest = max(passed, default=None), min(failed, default=None)
    return {
        "cap_gib": cap, "variant": variant, "start": None, "longest": longest, "shortest_failure": shortest,
        "resolution": shortest - longest if longest and shortest else None, "stopped": "parallel grid",
        "target": TARGETS.get(int(cap)) if variant == "tunedeck" else None, "probes": done,
    }  # fmt: skip


def smoke(lengths: list[int], variant: str) -> list[dict[str, Any]]:
    """Memory per phase at several lengths in one uncapped process (to seed the search), chunking on and off."""
    from engine.speed import SpeedController

    device = torch.device("cuda")
    config = llama_8b_config()
    model = with_lora(build_quantized_model(config, device), variant)
    model.train()
    rows = [{"phase": "model", "allocated_gib": torch.cuda.memory_allocated(device) / GIB}]
    for tokens in lengths:
        for chunked in (True, False) if variant == "tunedeck" else (False,):
            settings = dataclasses.replace(speed_settings(variant), chunked_mlp=chunked)
            controller = SpeedController(model, settings, device)
            try:
                steps = train_steps(model, controller, one_document(tokens, config.vocab_size), 1, device)
                rows.append({"tokens": tokens, "chunked": chunked, "steps": steps, "state": controller.state()})
            except torch.OutOfMemoryError:
                rows.append({"tokens": tokens, "chunked": chunked, "error": "out of memory"})
            controller.apply(dataclasses.replace(settings, chunked_mlp=False))
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1])[:600], flush=True)
    return rows


# --- reporting ----------------------------------------------------------------------------------------------------


def environment_line(meta: dict[str, Any]) -> str:
    """The report's "GPU: ..., date, library versions" line from :func:`environment`'s record."""
    return f"GPU: {meta['gpu']}, {meta['date']}, " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())


def environment() -> dict[str, Any]:
    import peft
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    try:
        import bitsandbytes

        versions["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        versions["bitsandbytes"] = "not installed"
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "gpu": props.name if props else "none",
        "total_gib": round(props.total_memory / GIB, 1) if props else 0,
        "versions": versions,
        "date": datetime.date.today().isoformat(),
    }


def markdown(report: dict[str, Any]) -> str:
    meta = report["environment"]
    lines = [
        "# Longest trainable row: Llama-3.1-8B-shaped QLoRA under 8, 16 and 24 GiB",
        "",
        environment_line(meta),
        "",
        "Random-init Llama-3.1-8B shape (vocab 128,256, hidden 4,096, 32 layers, 32/8 heads, MLP 14,336), NF4 with",
        "double quantization, LoRA r32 on all linear layers, batch size 1, one document filling the row, two full",
        "AdamW steps, each length in a fresh process, allocator capped with `set_per_process_memory_fraction`",
        "(the CUDA context, ~0.5 GiB on a real card, is not counted). `tunedeck` = the memory switches of the",
        "TuneDeck version that ran (each probe's `state` in the JSON lists them); AdamW with float32 states;",
        "`stock` = transformers + peft (`prepare_model_for_kbit_training`, standard checkpointing, sdpa; every",
        "TuneDeck switch off, step graphs included). Peak GiB (reserved): the true peak, the allocator's peak",
        "reserved memory.",
        "",
        "| variant | cap GiB | longest that trains | shortest that failed | resolution | target "
        "| peak GiB (reserved) at longest | planned GiB | s/step at longest | probes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["searches"]:
        best = next((p for p in row["probes"] if p["ok"] and p["tokens"] == row["longest"]), None)
        peak = f"{peak_gib(best):.2f}" if best else "-"
        planned = f"{best['planned_peak_gib']:.2f}" if best and "planned_peak_gib" in best else "-"
        step = f"{best['steps'][-1]['seconds']:.1f}" if best else "-"
        probes = ", ".join(f"{p['tokens']:,}{'✓' if p['ok'] else '✗'}" for p in row["probes"])

        def fmt(value: int | None) -> str:
            return f"{value:,}" if value else "-"

        lines.append(
            f"| {row['variant']} | {row['cap_gib']:g} | {fmt(row['longest'])} | {fmt(row['shortest_failure'])} "
            f"| {fmt(row['resolution'])} | {fmt(row['target'])} | {peak} | {planned} | {step} | {probes} |"
        )
    lines += ["", *report.get("notes", [])]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tunedeck bench --long-context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default="8,16,24", help="allocator caps in GiB")
    parser.add_argument("--starts", default="8192,32768,65536", help="first length probed for each cap")
    parser.add_argument("--variants", default="tunedeck", help="tunedeck and/or stock")
    parser.add_argument("--variant", default="tunedeck", help=argparse.SUPPRESS)
    parser.add_argument("--resolution", type=int, default=2048, help="stop bisecting below this many tokens")
    parser.add_argument("--growth", type=float, default=2.0, help="factor of the exponential phase")
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds after which no probe starts")
    parser.add_argument("--min-probe-s", type=float, default=25.0, help="a probe needs at least this much time left")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/long_context.json"), help="JSON (+ .md beside)")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", help="comma-separated lengths: memory per phase in one uncapped process")
    parser.add_argument("--grid", help="comma-separated lengths probed at once under the first cap (no search)")
    args = parser.parse_args(argv)
    args.caps = [float(c) for c in args.caps.split(",") if c]
    args.starts = [int(s) for s in args.starts.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tunedeck bench --long-context needs an NVIDIA GPU (torch sees none)", file=sys.stderr)
        return 2
    if args.probe:
        print(json.dumps(probe(args.probe, args.caps[0], args.variant)), flush=True)
        return 0
    report: dict[str, Any] = {"environment": environment(), "settings": {k: str(v) for k, v in vars(args).items()}}
    if args.smoke:
        report["smoke"] = smoke([int(t) for t in args.smoke.split(",")], args.variant)
    elif args.grid:
        lengths = [int(t) for t in args.grid.split(",")]
        report["searches"] = [grid_over_lengths(lengths, args.caps[0], args.variants[0], args)]
    else:
        report["searches"] = run_searches(args)
    write_report(report, args.out, markdown(report) if "searches" in report else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
