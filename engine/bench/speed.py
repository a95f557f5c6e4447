"""``tunedeck bench``: stock transformers+PEFT against each speed optimization, on one GPU, in one run.

Everything is measured in the same process on the same packed batch: ms/step (median after warm-up), tokens/s,
the true memory peak (the allocator's peak reserved memory, step graphs' pool included: engine.hardware.vram),
device->host syncs per step (counted with CUDA sync debug mode) and MFU against a bf16 matmul peak measured in the
same run. ``stock`` is stock transformers+PEFT: every TuneDeck switch off, step graphs included. Models are
random-init from architecture configs (nothing is downloaded), and this module imports neither Qt nor
``datasets``, so it runs on a bare GPU machine: ``python -m engine.bench.speed``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from engine.config import SpeedConfig
from engine.data.packing import PackedBatch, TokenizedExample, collate
from engine.hardware.allocator import set_at_process_start
from engine.hardware.shapes import BUILTIN_CONFIGS
from engine.hardware.vram import read_step_peak, reset_step_peak
from engine.run import guard

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

DENSE_SHAPES: dict[str, dict[str, Any]] = {
    # the planner's built-in shapes, plus the context length the random-init model is built with
    "qwen3-0.6b": dict(BUILTIN_CONFIGS["qwen3-0.6b"], max_position_embeddings=65536),
    "llama-3.2-1b": dict(BUILTIN_CONFIGS["llama-3.2-1b"], max_position_embeddings=131072),
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

STOCK = SpeedConfig.stock()
"""Every switch off, step graphs included: none is left automatic (automatic step graphs went on trial here, and
automatic resident layers under checkpointing), so each variant below runs exactly the switches its name says
(offloaded checkpointing's recompute skips unread frozen projections in every row that offloads)."""
ALL_ON: dict[str, Any] = dict(metadata_cache=True, fused_loss=True, lora_16bit=True, fused_kernels=True)
"""The throughput switches (the chunked MLP is for long rows on small cards: off here, as in stock)."""
# Variants of the dense runs: stock, each switch alone, all on; without and with checkpointing.
DENSE_VARIANTS: dict[str, SpeedConfig] = {
    "stock": STOCK,
    "metadata_cache": dataclasses.replace(STOCK, metadata_cache=True),
    "fused_loss": dataclasses.replace(STOCK, fused_loss=True),
    "fused_kernels": dataclasses.replace(STOCK, fused_kernels=True),
    "lora_16bit": dataclasses.replace(STOCK, lora_16bit=True),
    "all_on": dataclasses.replace(STOCK, **ALL_ON),
    "all_on-lora_16bit": dataclasses.replace(STOCK, **{**ALL_ON, "lora_16bit": False}),
    "stock+standard_ckpt": dataclasses.replace(STOCK, checkpointing="standard"),
    "stock+offloaded_ckpt": dataclasses.replace(STOCK, checkpointing="offloaded"),
    "metadata_cache+standard_ckpt": dataclasses.replace(STOCK, metadata_cache=True, checkpointing="standard"),
    "all_on+standard_ckpt": dataclasses.replace(STOCK, checkpointing="standard", **ALL_ON),
    "all_on+offloaded_ckpt": dataclasses.replace(STOCK, checkpointing="offloaded", **ALL_ON),
    "all_on+offloaded_ckpt+chunked_mlp": dataclasses.replace(
        STOCK, checkpointing="offloaded", chunked_mlp=True, **ALL_ON
    ),
}
LONG_VARIANTS = ("metadata_cache+standard_ckpt", "all_on+offloaded_ckpt")
MOE_MODES = {"eager": "eager", "stock_grouped_mm": "grouped_mm", "bincount": "bincount", "sync-free": "sync-free"}


# --- measuring -------------------------------------------------------------------------------------------------


@contextmanager
def count_syncs(sites: list[str] | None = None) -> Iterator[list[int]]:
    """Counts device->host synchronisations (CUDA sync debug mode warnings) inside the block; ``sites`` receives
    where each one came from: the Python call chain that synchronised, innermost last (``file:line`` each)."""
    counter = [0]
    stacks: list[str] = []

    def record(message: Warning | str, *_: Any, **__: Any) -> None:
        if "synchronizing" in str(message):
            frames = traceback.extract_stack()[:-1]
            stacks.append(" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-6:])))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")  # reports itself as a sync, the first time in a process
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            yield counter
        finally:
            # the debug mode goes off first: torch.cuda.synchronize() itself is reported as a sync
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    counter[0] = len(stacks)
    if sites is not None:
        sites.extend(stacks)


SETTLE_STEPS = 8
"""Warm-up steps at most beyond ``--warmup`` while an automatic choice is still measuring."""


def settle(step: Callable[[], object], settled: Callable[[], bool], wait: Callable[[], None], limit: int) -> int:
    """Warm-up steps until ``settled()`` (an automatic choice that measures itself first, such as step graphs on
    trial, has decided), each waited for so what it timed is done; at most ``limit``. Returns how many ran."""
    extra = 0
    while not settled() and extra < limit:
        step()
        wait()
        extra += 1
    return extra


def graphs_decided(controller: Any) -> bool:
    """Automatic step graphs have their trial's verdict (or were never on trial)."""
    return controller.graphs.trial is None


def time_steps(
    step: Callable[[], object], warmup: int, steps: int, settled: Callable[[], bool] = lambda: True
) -> dict[str, Any]:
    """Median ms/step after warm-up, the true memory peak over the timed steps, syncs in one extra step.

    The warm-up runs until ``settled()`` too (:func:`settle`), so no timed step still measures an automatic
    choice. Its wall time and steps are reported: with the fused kernels on it includes compiling them.
    ``host_ms`` is how long the host took to queue a step's work (the median, before waiting for the GPU): close
    to ``ms_per_step``, the host's Python and launch overhead sets the pace, not the GPU.

    Memory: ``peak_vram_gib`` and ``true_peak_gib`` are the true peak (the allocator's peak reserved memory, step
    graphs' pool included), ``allocated_peak_gib`` the bytes in live tensors only (what ``peak_vram_gib`` held
    before the true peak), ``driver_gib`` the process's GPU memory as NVML reports it (None where it cannot)."""
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warmup += settle(step, settled, torch.cuda.synchronize, SETTLE_STEPS)
    warmup_s = time.perf_counter() - start
    reset_step_peak(device)
    times, queued = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        queued.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = read_step_peak(device)
    sites: list[str] = []
    with count_syncs(sites) as syncs:
        step()
    return {
        "ms_per_step": statistics.median(times),
        "ms_all": times,
        "host_ms": statistics.median(queued),
        "warmup_s": warmup_s,
        "warmup_steps": warmup,
        "peak_vram_gib": peak.true_peak / 2**30,
        "true_peak_gib": peak.true_peak / 2**30,
        "allocated_peak_gib": peak.allocated / 2**30,
        "reserved_gib": peak.reserved / 2**30,
        "driver_gib": peak.driver / 2**30 if peak.driver is not None else None,
        "syncs": syncs[0],
        "sync_sites": sites,
    }


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
    flops: float = 4 * linear * tokens + 3 * attention_fwd
    return flops


def bench_adamw(model: Any, lr: float, choice: str = "auto") -> torch.optim.Optimizer:
    """The AdamW a training run builds on this device (engine.run.optimizer: fused on an NVIDIA GPU), for every
    row, stock too: transformers' Trainer uses the fused AdamW by default. ``choice``: as ``--adamw``."""
    from engine.run.optimizer import adamw

    params = [p for p in model.parameters() if p.requires_grad]
    return adamw(params, lr, 0.0, choice, params[0].device)


def train_step(
    model: Any, controller: Any, batch: PackedBatch, optimizer: torch.optim.Optimizer, as_trainer: bool = False
) -> torch.Tensor:
    """One optimizer step through the controller, as the training loop runs it; returns the detached loss.

    ``as_trainer``: the loss and the clipped gradient norm are read on the host before the update, as
    ``tunedeck train --step-readout immediate`` reads them for its guard and its progress (two host syncs a step,
    after which the GPU waits for the host's optimizer launch and the next step's preparation)."""
    loss = forward_backward(model, controller, batch, optimizer)
    if as_trainer:
        float(loss)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    optimizer.step()
    controller.zero_grad(optimizer)
    return loss


def forward_backward(model: Any, controller: Any, batch: PackedBatch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The micro-batch's forward and backward; where it runs out of memory beside step graphs, the graphs and
    their memory pool go and it runs again eagerly, and after that the resident layers checkpoint again, as the
    training loop recovers (``engine.run.step``)."""
    try:
        return cast(torch.Tensor, controller.forward_backward(model, batch, batch.trained_tokens))
    except Exception as err:
        if not guard.is_out_of_memory(err) or not controller.holds_spare_memory:
            raise
    # outside the except block: the traceback's frames, and the activations they hold, are gone
    controller.give_up_memory()
    guard.release_memory(optimizer, controller.device)
    return cast(torch.Tensor, controller.forward_backward(model, batch, batch.trained_tokens))


@dataclasses.dataclass
class LateReadout:
    """Steps as ``tunedeck train`` takes them with late readout (engine.run.readout): clipped, checked and updated
    on the GPU, each step's values read on the host after the next step is queued."""

    model: Any
    controller: Any
    optimizer: torch.optim.Optimizer
    previous: Any = None

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        from engine.run import readout

        loss = forward_backward(self.model, self.controller, batch, self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        values = readout.update_on_device(self.optimizer, params, loss, 1.0)
        self.controller.zero_grad(self.optimizer)
        sent = readout.send(values, None, 0.0)
        if self.previous is not None:
            self.previous.read()
        self.previous = sent
        return loss


def dense_step(
    model: Any, controller: Any, batch: PackedBatch, optimizer: torch.optim.Optimizer
) -> Callable[[], torch.Tensor]:
    return functools.partial(train_step, model, controller, batch, optimizer)


def bench_dense(name: str, args: argparse.Namespace, peak_tflops: float) -> list[dict[str, Any]]:
    """Every selected variant of one dense shape, then its kernel profile and the loss comparison."""
    from engine.speed import SpeedController

    device = torch.device("cuda")
    model = build_lora_model(DENSE_SHAPES[name], device)
    optimizer = bench_adamw(model, 1e-5)
    controller = SpeedController(model, STOCK, device)
    controller.chunked.chunk_tokens = args.chunk_tokens  # None: the model's default chunk size
    selected = [v for v in DENSE_VARIANTS if not args.variants or v in args.variants.split(",")]
    runs = [(args.tokens, v) for v in selected] + [(args.long_tokens, v) for v in LONG_VARIANTS if args.long_tokens > 0]
    vocab = DENSE_SHAPES[name]["vocab_size"]
    batches = {tokens: packed_row(tokens, vocab).to(device) for tokens, _ in runs}
    if args.compile_first:
        compile_variants(model, controller, optimizer, [(batches[t], v) for t, v in runs], args.warmup)
    rows = []
    with timing_turn(args.timing_lock, args.peers, name):
        for tokens, variant in runs:
            row = time_variant(name, variant, model, controller, optimizer, batches[tokens], args, peak_tflops)
            rows.append(log_row(row, args.rows_log))
        if args.profile_dir is not None:
            profile_variants(name, selected, model, controller, optimizer, batches[args.tokens], args)
        if args.loss_steps > 0:
            rows.append(log_row(compare_losses(name, model, controller, args), args.rows_log))
    controller.apply(STOCK)
    return rows


def profile_variants(
    name: str,
    selected: list[str],
    model: Any,
    controller: Any,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    args: argparse.Namespace,
) -> None:
    """Kernel profiles (--profile-variants) and what is alive at the memory peak (--memory-variants)."""
    from engine.bench.memory import record_peak

    out = args.profile_dir / name
    for variant in [v for v in args.profile_variants.split(",") if v in selected]:
        controller.apply(DENSE_VARIANTS[variant])
        _guarded(functools.partial(profile_step, dense_step(model, controller, batch, optimizer), out, variant))
    for variant in [v for v in args.memory_variants.split(",") if v in selected]:
        controller.apply(DENSE_VARIANTS[variant])
        # one step after the switch first, so one-off allocations (buffers, compiles) stay out of the trace
        _guarded(functools.partial(warm_up, model, controller, batch, optimizer, 1))
        _guarded(functools.partial(record_peak, dense_step(model, controller, batch, optimizer), out, variant))


def time_variant(
    name: str,
    variant: str,
    model: Any,
    controller: Any,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    args: argparse.Namespace,
    peak_tflops: float,
) -> dict[str, Any]:
    controller.apply(DENSE_VARIANTS[variant])
    row = {"model": name, "tokens": batch.num_tokens, "variant": variant, "state": controller.state()}
    step = dense_step(model, controller, batch, optimizer)
    decided = functools.partial(graphs_decided, controller)
    row.update(_guarded(functools.partial(time_steps, step, args.warmup, args.steps, decided)))
    row["state"] = controller.state()  # with the verdicts of choices that measured themselves first
    row.update(compile_counts())
    if "ms_per_step" in row:
        row["tokens_per_s"] = batch.num_tokens / row["ms_per_step"] * 1e3
        row["mfu"] = model_flops(model, batch) / (row["ms_per_step"] / 1e3) / (peak_tflops * 1e12)
    with contextlib.suppress(KeyError, ValueError, TypeError):  # a state the planner cannot read loses only this column
        capability = torch.cuda.get_device_capability()
        row["planned_peak_gib"] = planned_peak_gib(name, row["state"], batch.num_tokens, capability)
    print(_row_line(row), flush=True)
    torch.cuda.empty_cache()
    return row


def planned_peak_gib(name: str, state: dict[str, Any], tokens: int, capability: tuple[int, int]) -> float:
    """The memory planner's prediction for a variant's step, from the switches it ran with: beside the measured
    peak it shows how far to trust the planner on this GPU."""
    from engine.hardware.planner import GIB, state_peak_bytes
    from engine.hardware.shapes import ModelShape

    shape = ModelShape.from_config_dict(DENSE_SHAPES[name], name)
    return state_peak_bytes(shape, state, tokens, capability, lora_rank=16) / GIB


def compile_counts() -> dict[str, int]:
    """Graphs compiled so far in this process and graph breaks seen (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def compile_variants(
    model: Any, controller: Any, optimizer: torch.optim.Optimizer, runs: list[tuple[PackedBatch, str]], steps: int
) -> None:
    """Run the warm-up of every variant with fused kernels, so their compiles are done before anything is timed."""
    for batch, variant in runs:
        if DENSE_VARIANTS[variant].fused_kernels:
            controller.apply(DENSE_VARIANTS[variant])
            start = time.perf_counter()
            _guarded(functools.partial(warm_up, model, controller, batch, optimizer, steps))
            torch.cuda.synchronize()
            print(f"compiled {variant} ({batch.num_tokens} tokens) in {time.perf_counter() - start:.1f} s", flush=True)
    torch.cuda.empty_cache()


def warm_up(
    model: Any, controller: Any, batch: PackedBatch, optimizer: torch.optim.Optimizer, steps: int
) -> dict[str, Any]:
    for _ in range(steps):
        train_step(model, controller, batch, optimizer)
    return {}


@contextmanager
def timing_turn(lock: Path | None, peers: int, name: str) -> Iterator[None]:
    """Exclusive use of the GPU for timing when several bench processes share it (``--timing-lock``).

    Each process first marks itself ready (its compiles are done), waits until all ``peers`` are, then times
    its variants holding an exclusive lock: compiles run side by side, timed steps never overlap. A process marks
    itself under ``name`` and its process id, so peers benching the same model count as two.
    """
    if lock is None:
        yield
        return
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    (lock.parent / f"{lock.name}.ready.{name}.{os.getpid()}").touch()
    while len(list(lock.parent.glob(f"{lock.name}.ready.*"))) < peers:
        time.sleep(0.5)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def log_row(row: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """Append a measured row to the JSON-lines log (so a run cut short keeps what it measured)."""
    if path is not None:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, default=str) + "\n")
    return row


def profile_step(step: Callable[[], object], out: Path, variant: str = "all_on") -> dict[str, Any]:
    """Where one step's device time goes (after warm-up): the top kernels, and the top operators with their
    input shapes (which tell the LoRA matmuls, rank-wide, from the base ones), as tables under ``out``
    (``top_kernels.txt`` and ``top_ops.txt`` for all_on, prefixed by the variant's name for the others)."""
    from engine.bench.step_profile import profiled

    prof = profiled(step, record_shapes=True)
    out.mkdir(parents=True, exist_ok=True)
    events = prof.key_averages()
    kernels = events.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=100)
    prefix = "top" if variant == "all_on" else variant.replace("+", "_")
    (out / f"{prefix}_kernels.txt").write_text(kernels, encoding="utf-8")
    shaped = prof.key_averages(group_by_input_shape=True)
    ops = shaped.table(
        sort_by="self_device_time_total", row_limit=80, max_name_column_width=60, max_shapes_column_width=90
    )
    (out / f"{prefix}_ops.txt").write_text(ops, encoding="utf-8")
    return {}


def compare_losses(name: str, model: Any, controller: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Stock and all-on losses over the same rows from the same LoRA init (fresh AdamW each), in bf16."""
    device = torch.device("cuda")
    vocab = DENSE_SHAPES[name]["vocab_size"]
    rows = [
        packed_row(args.loss_tokens - 256 * (i % 4), vocab, seed=100 + i).to(device) for i in range(args.loss_steps)
    ]
    init = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    curves: dict[str, list[float]] = {}
    for variant in ("stock", "all_on"):
        with torch.no_grad():
            for k, v in model.named_parameters():
                if k in init:
                    v.copy_(init[k])
        optimizer = bench_adamw(model, 1e-4)
        controller.apply(DENSE_VARIANTS[variant])
        curves[variant] = [float(train_step(model, controller, batch, optimizer)) for batch in rows]
    diffs = [abs(a - b) / abs(b) for a, b in zip(curves["all_on"], curves["stock"], strict=True)]
    row = {"model": name, "loss_comparison": curves, "max_relative_difference": max(diffs), **compile_counts()}
    print(f"{name:>14} losses over {len(rows)} steps: all_on vs stock max relative difference {max(diffs):.2e}")
    return row


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
        f"{row.get('tokens_per_s', 0):9.0f} tok/s {row['peak_vram_gib']:6.2f} GiB reserved "
        f"(planned {row.get('planned_peak_gib', float('nan')):.2f}) syncs {row['syncs']} "
        f"warm-up {row.get('warmup_s', 0):.1f} s graphs {row.get('compiled_graphs')} breaks {row.get('graph_breaks')}"
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


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "variant" in r]


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and "ms_per_step" in r), None)


def ratios(dense: list[dict[str, Any]], moe: list[dict[str, Any]], tokens: int, long_tokens: int) -> dict[str, Any]:
    """The issue's targets as ratios measured in this run."""
    out: dict[str, Any] = {}
    for model in {r["model"] for r in dense}:
        pairs = {
            "all_on_vs_stock": ("stock", "all_on", tokens),
            "metadata_cache_alone_vs_stock": ("stock", "metadata_cache", tokens),
            "fused_loss_alone_vs_stock": ("stock", "fused_loss", tokens),
            "fused_kernels_alone_vs_stock": ("stock", "fused_kernels", tokens),
            "lora_16bit_alone_vs_stock": ("stock", "lora_16bit", tokens),
            "all_on_vs_all_on_without_lora_16bit": ("all_on-lora_16bit", "all_on", tokens),
            "all_on_offloaded_vs_stock_standard_ckpt": ("stock+standard_ckpt", "all_on+offloaded_ckpt", tokens),
            "all_on_offloaded_chunked_vs_stock_standard_ckpt": (
                "stock+standard_ckpt",
                "all_on+offloaded_ckpt+chunked_mlp",
                tokens,
            ),
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
        for variant in ("all_on", "all_on+offloaded_ckpt", "all_on+offloaded_ckpt+chunked_mlp"):
            row = _find(dense, model=model, variant=variant, tokens=tokens)
            if row:
                out[f"{model}:{variant}:mfu"] = row["mfu"]
                out[f"{model}:{variant}:peak_vram_gib"] = row["peak_vram_gib"]
        loss = next((r for r in dense if r.get("model") == model and "max_relative_difference" in r), None)
        if loss:
            out[f"{model}:loss_all_on_vs_stock_max_relative_difference"] = loss["max_relative_difference"]
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


def merged_rows(paths: list[Path]) -> tuple[dict[str, Any], float, list[dict[str, Any]]]:
    """(environment, mean bf16 peak, dense rows) from the rows logs of bench processes that ran side by side."""
    headers: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            (headers if "peak_tflops" in row else rows).append(row)
    return headers[0]["environment"], statistics.mean(h["peak_tflops"] for h in headers), rows


def carried_moe(path: Path) -> tuple[list[dict[str, Any]], str]:
    """An earlier report's MoE rows and a line saying when and with what they were measured."""
    earlier = json.loads(path.read_text(encoding="utf-8"))
    source = earlier.get("moe_environment") or earlier.get("environment", {})
    note = (
        f"MoE rows carried over from the earlier report {path.name}: measured {source.get('date', '(date unknown)')} "
        f"with torch {source.get('torch', '?')}, not re-run with the dense rows above."
    )
    return earlier.get("moe", []), note


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# TuneDeck speed benchmark — {env['gpu']} (sm_{env['capability'].replace('.', '')})",
        "",
        f"{env['date']}; torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
        f"peft {env['peft']}; bf16 matmul peak measured in this run: {report['peak_tflops']:.0f} TFLOP/s.",
        "Random-init models from architecture configs, LoRA r16 on all 7 projections, AdamW, one packed row.",
        "",
        "`stock`: every TuneDeck switch off, step graphs included. Peak GiB (reserved): the allocator's peak reserved",
        "memory over the timed steps, step graphs' pool included (engine.hardware.vram); allocated GiB: live tensors",
        "only, what this table's peak column showed before.",
        "",
        "| model | tokens | variant | ms/step | tokens/s | peak GiB (reserved) | allocated GiB | planned GiB "
        "| syncs/step | MFU |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in timed_rows(report["dense"]):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['variant']} | error: {r['error'][:80]} | | | | | | |")
            continue
        planned = f"{r['planned_peak_gib']:.2f}" if "planned_peak_gib" in r else "-"
        true_peak, allocated = _gib(true_peak_gib(r)), _gib(r.get("allocated_peak_gib", r["peak_vram_gib"]))
        lines.append(
            f"| {r['model']} | {r['tokens']:,} | {r['variant']} | {r['ms_per_step']:,.1f} | {r['tokens_per_s']:,.0f} "
            f"| {true_peak} | {allocated} | {planned} | {r['syncs']} | {r['mfu'] * 100:.1f}% |"
        )
    losses = [r for r in report["dense"] if "max_relative_difference" in r]
    if losses:
        lines += [
            "",
            f"Losses over {report['settings'].get('loss_steps')} steps (rows of about "
            f"{report['settings'].get('loss_tokens')} tokens, same LoRA init and rows, bf16, AdamW lr 1e-4):",
            "",
        ]
        lines += ["| model | step 1 stock / all-on | last step stock / all-on | max relative difference |"]
        lines += ["|---|---:|---:|---:|"]
        for r in losses:
            stock, fast = r["loss_comparison"]["stock"], r["loss_comparison"]["all_on"]
            lines.append(
                f"| {r['model']} | {stock[0]:.4f} / {fast[0]:.4f} | {stock[-1]:.4f} / {fast[-1]:.4f} "
                f"| {r['max_relative_difference']:.2e} |"
            )
    if report.get("moe_note"):
        lines += ["", report["moe_note"]]
    lines += ["", "| MoE block | dtype | tokens | routing | ms fwd+bwd | syncs |", "|---|---|---:|---|---:|---:|"]
    for r in report["moe"]:
        ms = f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else f"error: {r['error'][:60]}"
        lines.append(f"| {r['block']} | {r['dtype']} | {r['tokens']:,} | {r['mode']} | {ms} | {r.get('syncs', '')} |")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [
        f"| {k} | {v:.2f} |" if abs(v) >= 0.01 else f"| {k} | {v:.2e} |" for k, v in sorted(report["ratios"].items())
    ]
    lines += ["", *report.get("notes", [])]
    return "\n".join(lines) + "\n"


def true_peak_gib(row: dict[str, Any]) -> float | None:
    """A row's true peak: ``true_peak_gib``, or in rows from before it the reserved peak over the same timed steps
    (the same measure; their ``peak_vram_gib`` is the allocated peak); None where neither was recorded."""
    return row.get("true_peak_gib", row.get("reserved_gib"))


def _gib(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


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
    parser.add_argument(
        "--variants", default="", help=f"dense variants to run (default all): {', '.join(DENSE_VARIANTS)}"
    )
    parser.add_argument("--chunk-tokens", type=int, default=None, help="chunk size of the chunked-MLP variants")
    parser.add_argument("--loss-steps", type=int, default=20, help="steps of the all-on vs stock loss comparison")
    parser.add_argument("--loss-tokens", type=int, default=4096, help="row length of the loss comparison")
    parser.add_argument("--profile-dir", type=Path, default=None, help="write profiles of one step per variant here")
    parser.add_argument("--profile-variants", default="all_on", help="variants to profile (with --profile-dir)")
    parser.add_argument(
        "--memory-variants", default="", help="variants whose memory peak is broken down by allocation site"
    )
    parser.add_argument("--carry-moe", type=Path, default=None, help="take the MoE rows from this earlier report")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak for MFU (default: measure)")
    parser.add_argument("--compile-first", action="store_true", help="compile every fused variant before timing")
    parser.add_argument("--timing-lock", type=Path, default=None, help="lock file shared by parallel bench processes")
    parser.add_argument("--peers", type=int, default=1, help="bench processes sharing --timing-lock")
    parser.add_argument("--rows-log", type=Path, default=None, help="append every measured row to this JSON-lines file")
    parser.add_argument("--merge", type=Path, nargs="*", default=None, help="build the report from these rows logs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/speed.json"), help="JSON output path")
    parser.add_argument("--table", type=Path, default=None, help="markdown table path (default: beside --out)")
    parser.add_argument(
        "--long-context", action="store_true", help="longest 8B QLoRA row under 8/16/24 GiB (its own options)"
    )
    parser.add_argument(
        "--app-path",
        action="store_true",
        help="the 8B QLoRA row through `tunedeck train` and the window's run path, fresh processes (its own options)",
    )
    parser.add_argument(
        "--qlora",
        action="store_true",
        help="4-bit 8B fine-tuning, stock against TuneDeck under 8/24 GiB (its own options)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The 16-bit rows (``--app-path``, ``--qlora`` and ``--long-context`` are :mod:`engine.bench.command`'s)."""
    set_at_process_start()  # as the app and the CLI do: the bench measures what users get
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.merge is not None:
        env, peak, dense = merged_rows(args.merge)
    elif not torch.cuda.is_available():
        print("tunedeck bench needs an NVIDIA GPU (torch sees none)", file=sys.stderr)
        return 2
    else:
        env, peak = environment(), args.peak_tflops or matmul_peak_tflops()
        print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
        log_row({"environment": env, "peak_tflops": peak}, args.rows_log)
        dense = [row for name in filter(None, args.models.split(",")) for row in bench_dense(name, args, peak)]
    moe = [
        row
        for name in filter(None, args.moe_blocks.split(","))
        for dtype in filter(None, args.moe_dtypes.split(","))
        for row in bench_moe(name, getattr(torch, dtype), args)
    ]
    moe_note = None
    if args.carry_moe is not None:
        moe, moe_note = carried_moe(args.carry_moe)
    report = {
        "environment": env,
        "moe_note": moe_note,
        "notes": args.note,
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
