"""How a run scales from 1 to N GPUs: tokens/s of the training step under DDP, one packed row per GPU.

``python -m engine.bench.multi_gpu --gpus 2 --out benchmarks/multi_gpu_h200x2`` starts torchrun twice (1 rank,
then N ranks), each rank training LoRA on a randomly initialised model of the named shape (engine.bench.speed's
DENSE_SHAPES; no download) with its own packed row of ``--tokens`` tokens, every speed switch on, bf16, through
the same DDP wrapper and loss module as a real run (engine.run.ranks). A step is timed from a
synchronized start to the slowest rank's end; the median step gives tokens/s = N x tokens / time. The issue's
target is a 2-GPU/1-GPU ratio of at least 1.85. Writes ``OUT.json`` and a markdown table ``OUT.md``; prints the
table last. ``--device cpu`` runs the same path on gloo processes (a smoke test of this script, not a measure).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import SpeedConfig
from engine.hardware.vram import read_step_peak

if TYPE_CHECKING:
    from engine.run.ranks import Ranks

TARGET_RATIO = 1.85
SPEED_PRESETS = ("all", "all-eager", "auto", "stock")


def speed_settings(preset: str) -> SpeedConfig:
    """``all``: the switches engine.bench.speed turns on together (no checkpointing: the row fits); ``all-eager``: the
    same without fused kernels (no minute-long compile per process); ``auto``: the engine's own choices;
    ``stock``: engine.bench.speed's everything-off baseline."""
    from engine.bench.speed import ALL_ON, STOCK

    if preset == "all":
        return dataclasses.replace(STOCK, **ALL_ON)
    if preset == "all-eager":
        return dataclasses.replace(STOCK, **{**ALL_ON, "fused_kernels": False})
    if preset == "stock":
        return STOCK
    return SpeedConfig()


# --- one rank ---------------------------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> int:
    """Under torchrun: time ``--steps`` DDP steps and (rank 0) write the result to ``--result``."""
    import torch.distributed as dist

    from engine.bench.speed import DENSE_SHAPES, bench_adamw, build_lora_model, packed_row
    from engine.distributed.group import init_ranks
    from engine.speed import SpeedController

    began = time.perf_counter()
    ranks, device = init_ranks(args.device)
    ranks = dataclasses.replace(ranks, mode="ddp" if ranks.distributed else "single")
    shape = DENSE_SHAPES[args.shape]
    model = build_lora_model(shape, device)
    _progress(ranks, began, f"{args.shape} built on {device}")
    controller = SpeedController(model, speed_settings(args.speed), device)
    loss_module = ranks.wrap(model, device)
    optimizer = bench_adamw(model, 1e-5)
    batch = packed_row(args.tokens, shape["vocab_size"], seed=ranks.rank).to(device)

    def compute(m: torch.nn.Module) -> torch.Tensor:
        inputs = controller.model_inputs(batch)
        return controller.loss(m, inputs, batch.labels, batch.trained_tokens, positions=batch.loss_positions)

    def step() -> None:
        loss = loss_module(compute) if loss_module is not None else compute(model)
        (loss * ranks.loss_scale).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for index in range(args.warmup + args.steps):  # the first step compiles (fused kernels: about 75 s on an H200 host)
        times.append(_timed(step, ranks, device))
        _progress(ranks, began, f"step {index + 1}: {times[-1] * 1e3:.1f} ms")
    times = times[args.warmup :]
    memory = read_step_peak(device, driver=False).true_peak if device.type == "cuda" else 0  # reserved: graph pools too
    _, rank_memory = ranks.reduce_step(0.0, memory) if ranks.distributed else (0.0, [memory])
    if ranks.is_main:
        median = statistics.median(times)
        result = {
            "gpus": ranks.world,
            "tokens_per_gpu": args.tokens,
            "step_ms_median": median * 1e3,
            "step_ms": [t * 1e3 for t in times],
            "tokens_per_s": ranks.world * args.tokens / median,
            "true_peak_gib_per_rank": [m / 2**30 for m in rank_memory or []],
            "speed": controller.state(),
        }
        Path(args.result).write_text(json.dumps(result, indent=2), encoding="utf-8")
    if ranks.distributed:
        ranks.barrier()  # no rank tears down its connections while another still uses them
        dist.destroy_process_group()
    return 0


def _timed(step: Callable[[], object], ranks: Ranks, device: torch.device) -> float:
    """One step from a common start to the slowest rank's end (seconds)."""
    _sync(device)
    ranks.barrier()
    start = time.perf_counter()
    step()
    _sync(device)
    elapsed = time.perf_counter() - start
    return max(ranks.reduce_sums(*[elapsed if r == ranks.rank else 0.0 for r in range(ranks.world)]))


def _progress(ranks: Any, began: float, message: str) -> None:
    """A line on stderr per stage, so a run cut short by a timeout still shows where its time went."""
    print(
        f"[{time.perf_counter() - began:7.1f} s] rank {ranks.rank}/{ranks.world}: {message}",
        file=sys.stderr,
        flush=True,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the launcher -----------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One torchrun of ``world`` ranks of this script; its rank 0's result."""
    from engine.distributed.launch import launch_command

    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        command = [*launch_command(world)[:-1], "engine.bench.multi_gpu", *_rank_args(args, result)]
        env = dict(os.environ)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        if args.device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(world)))
        started = time.perf_counter()
        code = _run_group(command, env, args.timeout)
        if not result.exists():  # written by rank 0 after the timed steps; a teardown failure later is reported
            raise RuntimeError(f"{world}-GPU measurement failed (torchrun exit code {code}); its output is above")
        measured: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
        measured["wall_s"] = time.perf_counter() - started
        measured["exit_code"] = code
        return measured


def _run_group(command: list[str], env: dict[str, str], timeout: float) -> int:
    """Run torchrun in its own session, its output streamed to ours; past ``timeout`` the whole group is killed."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        print(f"(killed after {timeout:.0f} s)", file=sys.stderr, flush=True)
        return process.wait()


def _rank_args(args: argparse.Namespace, result: Path) -> list[str]:
    return [
        "--rank-worker",
        f"--result={result}",
        f"--shape={args.shape}",
        f"--tokens={args.tokens}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--speed={args.speed}",
        f"--device={args.device}",
    ]


def environment(device: str) -> dict[str, Any]:
    import peft
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
    }
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Multi-GPU scaling: {report['shape']}, {report['tokens_per_gpu']:,} tokens per GPU, DDP, bf16",
        "",
        f"{env.get('gpu', 'CPU')} x{report['gpus']}; torch {env['torch']}, CUDA {env.get('cuda', '-')}, "
        f"NCCL {env.get('nccl', '-')}, transformers {env['transformers']}, peft {env['peft']}; "
        f"NCCL_NVLS_ENABLE={env['NCCL_NVLS_ENABLE']}; speed switches: {report['speed']} ({_on(report)}); {env['date']}",
        "",
        "| GPUs | step (ms, median) | tokens/s | peak memory per GPU (GiB, reserved) |",
        "|---:|---:|---:|---|",
    ]
    for row in report["results"]:
        memory = ", ".join(f"{m:.1f}" for m in row["true_peak_gib_per_rank"])
        lines.append(f"| {row['gpus']} | {row['step_ms_median']:.1f} | {row['tokens_per_s']:,.0f} | {memory} |")
    verdict = "meets" if report["ratio"] >= TARGET_RATIO else "misses"
    lines += ["", f"**{report['gpus']}-GPU / 1-GPU tokens/s: {report['ratio']:.3f}x** ({verdict} {TARGET_RATIO}x)"]
    return "\n".join(lines) + "\n"


def _on(report: dict[str, Any]) -> str:
    on = [name for name, value in report["speed_settings"].items() if value is True]
    return ", ".join(on) or "none forced on"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.multi_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the scaled run (compared with 1)")
    parser.add_argument("--shape", default="llama-3.2-1b", help="a model shape of engine.bench.speed.DENSE_SHAPES")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of each GPU's packed row")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--speed", choices=SPEED_PRESETS, default="all", help="speed switches")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo smoke test")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for each torchrun")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_worker:
        return rank_main(args)
    try:
        results = [measure(args, 1), measure(args, args.gpus)]
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    report = {
        "shape": args.shape,
        "tokens_per_gpu": args.tokens,
        "gpus": args.gpus,
        "parallel": "ddp",
        "dtype": "bfloat16",
        "speed": args.speed,
        "speed_settings": dataclasses.asdict(speed_settings(args.speed)),
        "steps": args.steps,
        "warmup": args.warmup,
        "environment": environment(args.device),
        "results": results,
        "ratio": results[1]["tokens_per_s"] / results[0]["tokens_per_s"],
        "target_ratio": TARGET_RATIO,
    }
    table = markdown(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        args.out.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
