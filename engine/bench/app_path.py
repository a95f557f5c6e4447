"""The QLoRA row through the paths users take, each in a fresh process: ``tunedeck bench --app-path``.

A benchmark that builds its own model in memory measures the engine, not what a user gets. This one runs the
product's own entry points on a random-init model folder (engine.bench.model_folder) with nothing exported in the
environment (no ``PYTORCH_CUDA_ALLOC_CONF``), each in a fresh process, in the order the product makes its calls:

- ``cli``: ``tunedeck train``: the allocator setting at process start, then the command (engine.cli).
- ``app``: the window: the allocator setting at process start (app.__main__), hardware detection and the device
  profile (the window detects when it is shown), then the training worker's run (engine.train.run_beside_window,
  the Qt-free body of app.background.worker.TrainingWorker) on a thread of its own, stopped as the Stop button stops it.
- ``app-oom``: the window's path with a real CUDA out-of-memory error in step 2 (a tensor takes the memory left
  under the cap while the step runs and goes when it fails), to show what a shortage costs the rest of the run.
- ``app-cuda-first``: the window's path with CUDA started before the allocator setting (any launcher that touches
  CUDA first): the run applies it through torch's settings API.

An allocator cap (``torch.cuda.set_per_process_memory_fraction``, made right after the allocator setting, as the
one call a user's smaller card does not need) emulates a smaller GPU; the CUDA context is not counted. Runs are
configured as a real run (``--planned-steps``, so choices that weigh the run's length see one) and stopped after
``--steps``. Tokens/s: median of the steps after the first ``TIMED_AFTER``; the OOM row is also given over its
last ten steps. Memory: the run's own per-step true peak (engine.hardware.vram), as the app shows it.

    tunedeck bench --app-path --out benchmarks/qlora_app_path_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.bench import gpu_environment

__all__ = ["PATHS", "main", "summary"]

GIB = 2**30
PATHS = ("cli", "app", "app-oom", "app-cuda-first")
TIMED_AFTER = 10
"""Steps left out of the median: compiles, the step-graph trial and the first replays."""
OOM_STEP = 2
HOG_SLACK = 2**20
"""Memory the hog leaves free under the cap in the OOM row: less than any step's work needs."""
PAGE = 2 * 2**20
"""The allocator's granularity for large blocks and expandable segments."""
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


# --- the child: one path in one fresh process ----------------------------------------------------------------------


def cap_memory(cap_gib: float | None) -> None:
    """Emulate a smaller card: the allocator may hold at most ``cap_gib`` (nothing on a CPU-only machine)."""
    import torch

    if cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))


def detect_like_the_window() -> None:
    """What the window runs when it is first shown: hardware detection and the device profile (app.pages.hardware)."""
    from engine.hardware.detect import detect_hardware
    from engine.hardware.profile import build_profile

    build_profile(detect_hardware())


def child_cli(cap_gib: float | None, train: list[str]) -> int:
    """``tunedeck train``: the CLI's own first call, the emulation cap, then the command."""
    from engine.cli.commands import main
    from engine.hardware.allocator import set_at_process_start

    set_at_process_start()
    cap_memory(cap_gib)
    code = main(train)
    report_allocator()
    return code


def child_app(path: str, cap_gib: float | None, train: list[str], steps: int) -> int:
    """The window's calls in the window's order, the run on a thread of its own, stopped after ``steps``."""
    from engine.hardware.allocator import set_at_process_start

    if path == "app-cuda-first":
        detect_like_the_window()
        set_at_process_start()
    else:
        set_at_process_start()
        detect_like_the_window()
    cap_memory(cap_gib)
    config = window_config(train)
    if path == "app-oom":
        short_of_memory_at(OOM_STEP)
    outcome: list[int] = []
    thread = threading.Thread(target=lambda: outcome.append(drive_window_run(config, steps)), name="TrainingWorker")
    thread.start()
    thread.join()
    report_allocator()
    return outcome[0] if outcome else 1


def report_allocator() -> None:
    """Whether the run's memory came in expandable segments, read from the allocator itself."""
    import torch

    from engine.hardware.allocator import check

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checked = check(device)
    print(json.dumps({"kind": "BenchAllocator", "expandable": checked.expandable, "reason": checked.reason}))


def window_config(train: list[str]) -> Any:
    """The RunConfig the window's form would make for the same settings (both fill the one config tree)."""
    from engine.cli.train import train_config, train_parser

    return train_config(train_parser().parse_args(train[1:]))


def drive_window_run(config: Any, steps: int) -> int:
    """app.background.worker.TrainingWorker.run without Qt: every event printed as the CLI's --json prints it."""
    from engine.events import RunFailed, StepMetrics
    from engine.run.control import RunControl
    from engine.train import run_beside_window

    control, failed = RunControl(), False
    for event in run_beside_window(config, control):
        print(json.dumps(event.to_dict()), flush=True)
        if isinstance(event, StepMetrics) and event.step >= steps:
            control.stop()  # what the Stop button does
        failed = failed or isinstance(event, RunFailed)
    return 1 if failed else 0


def short_of_memory_at(step: int) -> None:
    """A real CUDA out-of-memory error in ``step``: a tensor takes what the cap leaves while the step runs, once.

    On a CPU-only machine (the bench's own test) the allocator cannot run short, so the step raises the error
    torch would raise; the row says which it was."""
    import torch

    from engine.run import step as step_module

    real = step_module._accumulate
    fired: list[bool] = []

    def accumulate(session: Any, rows: list[int]) -> Any:
        if session.step + 1 != step or fired:
            return real(session, rows)
        fired.append(True)
        if session.device.type != "cuda":
            print(json.dumps({"kind": "BenchFault", "step": step, "real": False}), flush=True)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated on a CPU-only machine)")
        hog = _take_what_is_left(session.device)
        print(json.dumps({"kind": "BenchFault", "step": step, "real": True, "hog_bytes": hog.numel()}), flush=True)
        try:
            return real(session, rows)
        finally:
            del hog

    step_module._accumulate = accumulate


def _take_what_is_left(device: Any) -> Any:
    """A tensor of all the memory the cap leaves, the allocator's cache emptied first: the step's next allocation
    of any size fails (with the cache kept, a small model's step ran from cached blocks and never ran short)."""
    import torch

    from engine.speed import usable_device_memory

    torch.cuda.empty_cache()
    left = usable_device_memory(device) - torch.cuda.memory_reserved(device) - HOG_SLACK
    free, _ = torch.cuda.mem_get_info(device)
    size = max(0, min(left, free - HOG_SLACK)) // PAGE * PAGE
    return torch.empty(size, dtype=torch.uint8, device=device)


def child_main(args: argparse.Namespace) -> int:
    if args.child == "cli":
        return child_cli(args.cap, args.train)
    return child_app(args.child, args.cap, args.train, args.steps)


# --- the parent: every path, side by side --------------------------------------------------------------------------


def clean_environment() -> dict[str, str]:
    """The user's environment as it would be: no allocator setting exported."""
    return {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}


def child_command(path: str, cap: float | None, steps: int, train: list[str]) -> list[str]:
    cap_args = ["--cap", str(cap)] if cap else []
    return [sys.executable, "-m", "engine.bench.app_path", "--child", path, "--steps", str(steps), *cap_args, "--",
            *train]  # fmt: skip


def run_path(path: str, train: list[str], args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One path in a fresh process; the CLI is stopped as a user stops it (Ctrl-C) after ``args.steps`` steps."""
    started = time.perf_counter()
    command = child_command(path, args.cap, args.steps, train)
    root = Path(__file__).resolve().parents[2]
    events, stderr, returncode = run_child(command, root, clean_environment(), args.steps if path == "cli" else None)
    (logs / f"{path}.log").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    (logs / f"{path}.err").write_text(stderr)
    wall = time.perf_counter() - started
    return {"path": path, "returncode": returncode, "wall_s": round(wall), **summary(events)}


def run_child(
    command: list[str], cwd: Path, env: dict[str, str] | None, interrupt_after: int | None
) -> tuple[list[dict[str, Any]], str, int]:
    """A ``tunedeck train`` child's JSON events, its error stream and exit status; with ``interrupt_after``, one
    Ctrl-C once that step is reported (the run stops as a user stops it: at the end of its step, with a checkpoint).
    ``env`` None: this process's environment."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as child:  # fmt: skip
        stderr: list[str] = []
        reader = threading.Thread(target=lambda: stderr.extend(child.stderr or []), daemon=True)
        reader.start()
        events = list(_events(child, interrupt_after))
        returncode = child.wait()
        reader.join()
    return events, "".join(stderr), returncode


def _events(child: subprocess.Popen[str], interrupt_after: int | None) -> Iterator[dict[str, Any]]:
    """The child's JSON events as they come; with ``interrupt_after``, one Ctrl-C after that many steps."""
    interrupted = False
    for line in child.stdout or []:
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        yield event
        done = event.get("kind") == "StepMetrics" and interrupt_after and event["step"] >= interrupt_after
        if done and not interrupted:
            child.send_signal(signal.SIGINT)
            interrupted = True


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A path's figures from its events."""
    steps = [e for e in events if e.get("kind") == "StepMetrics"]
    rates = [s["tokens_per_s"] for s in steps]
    timed = _median(rates[TIMED_AFTER:] or rates)
    states = [e["state"] for e in events if e.get("kind") == "SpeedChanged"]
    drivers = [s["driver_memory_bytes"] for s in steps if s.get("driver_memory_bytes")]
    return {
        "tokens": steps[-1]["tokens"] if steps else None,
        "steps": len(steps),
        "tokens_per_s": round(timed) if timed else None,
        "last10_tokens_per_s": round(_median(rates[-10:]) or 0) or None,
        "ms_per_step": round(steps[-1]["tokens"] / timed * 1e3) if timed else None,
        "true_peak_gib": round(max(s["memory_bytes"] for s in steps) / GIB, 2) if steps else None,
        "driver_peak_gib": round(max(drivers) / GIB, 2) if drivers else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "outcome": next((e["kind"] for e in events if e.get("kind") in ("RunFinished", "RunFailed")), "no end"),
        "fault": next((e for e in events if e.get("kind") == "BenchFault"), None),
        "expandable_segments": next((e["expandable"] for e in events if e.get("kind") == "BenchAllocator"), None),
        "memory_events": [_memory_event(e) for e in events if e.get("kind") in ("OomRecovered", "SpeedRestored")],
        "notices": [e["message"] for e in events if e.get("kind") == "Notice"],
        "switches_on": sorted(k for k, v in (states[-1] if states else {}).items() if _is_on(v)),
    }


def _yes_no(value: bool | None) -> str:
    return "–" if value is None else ("yes" if value else "no")


def _memory_event(event: dict[str, Any]) -> str:
    return f"step {event['step']}: {event['kind']} {event['action']}"


def _is_on(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    return bool(value.get("on")) or value.get("mode") not in (None, "stock", "none")


def environment() -> dict[str, str]:
    return gpu_environment(("torch", "transformers", "peft", "bitsandbytes"))


def markdown(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    cli = next((r["tokens_per_s"] for r in rows if r["path"] == "cli" and r["tokens_per_s"]), None)
    env = rows[0] if rows else {}
    lines = [
        "# The QLoRA row through the paths users take: `tunedeck bench --app-path`",
        "",
        f"GPU: {env.get('gpu')}, {env.get('date')}, {env.get('versions')}",
        "",
        f"Model `{settings['shape']}` (random init), one {settings['tokens']:,}-token text row a step, QLoRA r32, "
        f"every switch automatic, allocator cap {settings['cap']} GiB; each path a fresh process with no "
        "`PYTORCH_CUDA_ALLOC_CONF` in its environment, configured for "
        f"{settings['planned_steps']} steps and stopped after {settings['steps']}. Tokens/s: median after step "
        f"{TIMED_AFTER}; true peak: the largest per-step peak of reserved memory the run reports (step graphs' pool "
        "included; the CUDA context is not counted); driver: the process's memory as NVML reports it, context "
        "included.",
        "",
        "| path | tokens/s | x cli | last 10 steps tokens/s | ms/step | true peak GiB | driver GiB | expandable "
        "segments | memory events |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / cli:.2f}" if cli and r["tokens_per_s"] else "–"
        events = "; ".join(r["memory_events"]) or "none"
        lines.append(
            f"| {r['path']} | {r['tokens_per_s'] or 0:,} | {ratio} | {r['last10_tokens_per_s'] or 0:,} | "
            f"{r['ms_per_step'] or 0} | {r['true_peak_gib']} | {r['driver_peak_gib'] or '–'} | "
            f"{_yes_no(r['expandable_segments'])} | {events} |"
        )
    notices = sorted({n for r in rows for n in r["notices"] if "memory" in n.lower() or "allocator" in n.lower()})
    if notices:
        lines += ["", "Memory notices:", *[f"* {n}" for n in notices]]
    return "\n".join(lines) + "\n"


def prepare(args: argparse.Namespace) -> list[str]:
    """The model folder and the rows (made once in ``--work``), and the ``tunedeck train`` arguments."""
    from engine.bench.model_folder import build_model_folder, train_args, write_rows

    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"rows_{args.tokens}.jsonl"
    write_rows(data, args.rows, words=args.tokens // 3 + 1)
    folder = args.work / (args.shape + ("-tiny" if args.tiny else ""))
    if not (folder / "config.json").exists():
        build_model_folder(args.shape, folder, tiny=args.tiny)
    return train_args(folder, data, args.tokens, args.planned_steps, args.work / "runs")


def parent_main(args: argparse.Namespace) -> int:
    train = prepare(args)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = []
    for path in args.paths.split(","):
        rows.append({**env, **run_path(path, train, args, logs)})
        print(json.dumps(rows[-1]), flush=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "train"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, settings))
    print(markdown(rows, settings))
    return 0 if all(r["outcome"] == "RunFinished" for r in rows) else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tunedeck bench --app-path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="cli,app,app-oom", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cap", type=float, default=8.0, help="allocator cap in GiB (0: none)")
    parser.add_argument("--steps", type=int, default=40, help="steps timed before the run is stopped")
    parser.add_argument("--planned-steps", type=int, default=400, help="the run's configured length")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="two narrow layers (a check of the bench itself)")
    parser.add_argument("--work", type=Path, default=Path("artifacts/app_path"))
    parser.add_argument("--out", type=Path, default=Path("artifacts/app_path/qlora_app_path.json"))
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("train", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
