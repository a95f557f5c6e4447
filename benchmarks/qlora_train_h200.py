"""QLoRA as a user runs it: ``tunedeck train --qlora`` on 8B-shaped models under 8-24 GiB allocator caps.

The QLoRA bench (``tunedeck bench --qlora``) times the engine's training step on a model it builds in memory.
This record runs the product itself: a random-init model folder in the Llama-3.1-8B or Qwen3-8B shape (bf16
safetensors shards and the demo model's tokenizer, since the GPU machine has no hub), a text dataset of long rows,
and ``tunedeck train --qlora --lora-rank 32`` with every switch automatic, in a process whose allocator is capped
to emulate a smaller card (``torch.cuda.set_per_process_memory_fraction``; the CUDA context is not counted).
It reads the run's JSON events: tokens/s and the memory peak of every step (the true peak, reserved memory with
step graphs' pool, since StepMetrics carried it; the allocated peak in logs from before), the switch states the run
chose, its final loss, and any warning printed on the run's error stream.

    python benchmarks/qlora_train_h200.py --shapes llama-3.1-8b,qwen3-8b --caps 8,12,16,24 \\
        --planned-steps 400 --out benchmarks/qlora_train_h200.json

A run configured for only ``--steps`` is a short run: compiling and step graphs stay off where they would not pay
back (about 70 s of compile against 12 s saved over 40 steps of the 8B 4,096-token row). ``--planned-steps 400``
configures each run as a long one and stops it after ``--steps``, as the records before that rule were measured.

Writes the JSON, a Markdown table beside it, and each run's stdout/stderr under ``--logs``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.bench.app_path import run_child
from engine.bench.model_folder import build_model_folder, shape_config, train_args, write_rows

__all__ = ["build_model_folder", "main", "shape_config", "summary", "switch_flags", "train_args", "write_rows"]

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
TIMED_AFTER = 10
"""Steps left out of the median: compiles, the step-graph trial and the first replays."""
CAPPED = (
    "import sys, torch; "
    "torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]) * 2**30 / "
    "torch.cuda.get_device_properties(0).total_memory); "
    "from engine.cli.commands import main; sys.exit(main(sys.argv[2:]))"
)
"""``tunedeck train`` in a process whose allocator is capped to ``argv[1]`` GiB."""


CHOICES = {"fp8_base": ("all", "off")}
"""Switches set by value: (the value ``+x`` gives, the value ``-x`` gives)."""


def switch_flags(variant: str) -> list[str]:
    """The ``tunedeck train`` flags of a variant: none for ``auto``; each ``-x_y`` tail gives ``--no-x-y``, each
    ``+x_y`` tail ``--x-y`` and each ``+x_y=value`` tail ``--x-y value`` (``auto+fp8_base=recompute``); a switch
    set by value (:data:`CHOICES`) takes its on or off value."""
    flags: list[str] = []
    for sign, switch in re.findall(r"([+-])([^+-]+)", variant[len("auto") :]):
        key, _, value = switch.partition("=")
        name = key.replace("_", "-")
        if key in CHOICES and not value:
            flags += [f"--{name}", CHOICES[key][0 if sign == "+" else 1]]
        else:
            flags += [f"--no-{name}"] if sign == "-" else [f"--{name}", *([value] if value else [])]
    return flags


def events_of(stdout: str) -> list[dict[str, Any]]:
    """The run's JSON events (``--json`` prints one per line), other lines skipped."""
    events = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def summary(events: list[dict[str, Any]], stderr: str) -> dict[str, Any]:
    """One run's figures: median tokens/s after the first :data:`TIMED_AFTER` steps, peak GiB, losses, the switches
    the run settled on (and its last reported switch state whole), and the warnings on its error stream.

    Peak: the largest step's ``memory_bytes``. Events that carry ``driver_memory_bytes`` report the true peak there
    (reserved memory, step graphs' pool included), and the run gets ``true_peak_gib`` and ``driver_peak_gib`` too;
    in older logs it is the allocated peak, under ``peak_gib`` alone."""
    steps = [e for e in events if e.get("kind") == "StepMetrics"]
    states = [e["state"] for e in events if e.get("kind") == "SpeedChanged"]
    finished = next((e for e in events if e.get("kind") in ("RunFinished", "RunFailed")), {})
    timed = [s["tokens_per_s"] for s in steps[TIMED_AFTER:]] or [s["tokens_per_s"] for s in steps]
    state = states[-1] if states else {}
    tokens_per_s = statistics.median(timed) if timed else None
    return {
        "steps": len(steps),
        "tokens_per_s": round(tokens_per_s) if tokens_per_s else None,
        "ms_per_step": round(steps[-1]["tokens"] / tokens_per_s * 1e3) if tokens_per_s else None,
        "peak_gib": round(max(s["memory_bytes"] for s in steps) / GIB, 2) if steps else None,
        **true_peaks(steps),
        "first_loss": steps[0]["loss"] if steps else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "outcome": finished.get("kind", "no end event"),
        "switches_on": sorted(k for k, v in state.items() if isinstance(v, dict) and _is_on(v)),
        "checkpointing": state.get("checkpointing", {}).get("mode"),
        "resident_layers": state.get("resident_layers", {}).get("layers"),
        "step_graphs": state.get("step_graphs", {}).get("reason"),
        "warnings": sorted({line.strip() for line in stderr.splitlines() if "warn" in line.lower()}),
        "state": state,
    }


def true_peaks(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """``true_peak_gib`` and ``driver_peak_gib`` where the steps' events report the true peak; none in older logs."""
    if not steps or "driver_memory_bytes" not in steps[0]:
        return {}
    driver = [s["driver_memory_bytes"] for s in steps if s.get("driver_memory_bytes")]
    return {
        "true_peak_gib": round(max(s["memory_bytes"] for s in steps) / GIB, 2),
        "driver_peak_gib": round(max(driver) / GIB, 2) if driver else None,
    }


def _is_on(value: dict[str, Any]) -> bool:
    return bool(value.get("on")) or value.get("mode") not in (None, "stock", "none")


def run(
    shape: str,
    folder: Path,
    data: Path,
    tokens: int,
    cap: float | None,
    steps: int,
    logs: Path,
    variant: str = "auto",
    planned: int | None = None,
) -> dict:
    """One capped ``tunedeck train`` run (no cap: ``cap`` None), its output kept under ``logs``. ``variant``:
    ``auto``, every switch automatic; ``auto-X``, speed switch X off; ``auto+X``, X switched on. ``planned``: the
    run is configured for that many steps and stopped with Ctrl-C after ``steps``, so choices that weigh the run's
    length (compiling, step graphs) see a long run."""
    stem = f"{shape}_{tokens}_{cap or 'uncapped'}gib" + ("" if variant == "auto" else f"_{variant}")
    length = planned if planned and planned > steps else steps
    args = train_args(folder, data, tokens, length, logs / "runs" / stem) + switch_flags(variant)
    command = [sys.executable, "-c", CAPPED, str(cap), *args] if cap else [sys.executable, "-m", "engine.cli", *args]
    started = time.perf_counter()
    stdout, stderr, returncode = _run_until(command, steps if length > steps else None)
    (logs / f"{stem}.log").write_text(stdout)
    (logs / f"{stem}.err").write_text(stderr)
    record = {
        "shape": shape, "tokens": tokens, "cap_gib": cap, "variant": variant,
        "wall_s": round(time.perf_counter() - started),
    }  # fmt: skip
    return {**record, "returncode": returncode, **summary(events_of(stdout), stderr)}


def _run_until(command: list[str], stop_after: int | None) -> tuple[str, str, int]:
    """The command's stdout (its JSON events with ``stop_after``), stderr and exit status; with ``stop_after``, one
    Ctrl-C once that step is reported (:func:`engine.bench.app_path.run_child`)."""
    if stop_after is None:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout, done.stderr, done.returncode
    events, stderr, returncode = run_child(command, ROOT, None, stop_after)
    return "".join(json.dumps(event) + "\n" for event in events), stderr, returncode


def from_logs(logs: Path) -> list[dict[str, Any]]:
    """Records rebuilt from the ``{shape}_{tokens}_{cap}gib.log/.err`` pairs a run left under ``logs``."""
    records = []
    for log in sorted(logs.glob("*gib*.log")):
        stem, _, variant = log.stem.partition("gib_")
        shape, tokens, cap = stem.removesuffix("gib").rsplit("_", 2)
        err = log.with_suffix(".err")
        stderr = err.read_text() if err.exists() else ""
        record = {
            "shape": shape, "tokens": int(tokens), "cap_gib": None if cap == "uncapped" else float(cap),
            "variant": variant or "auto",
        }  # fmt: skip
        records.append({**record, **summary(events_of(log.read_text()), stderr)})
    return sorted(records, key=lambda r: (r["shape"], r["tokens"], r["cap_gib"] or 0.0, r["variant"] != "auto"))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# QLoRA as a user runs it: `tunedeck train --qlora` on 8B shapes under allocator caps",
        "",
        f"GPU: {report.get('gpu', '?')}, {report.get('date', '?')}, {report.get('versions', '')}",
        "",
        "Random-init model folders (bf16 safetensors, the demo tokenizer), one text row per micro-batch filling it,",
        "`tunedeck train --qlora --lora-rank 32 --data-format text --train-on-all-tokens --eval-fraction 0` with",
        f"every speed switch automatic. Tokens/s: median of the steps after the first {TIMED_AFTER}. Peak: the",
        *_peak_words(report["runs"]),
        "Warnings: lines with 'warn' on the run's error stream.",
        "",
        "| model | tokens | cap GiB | variant | tokens/s | x auto | ms/step | peak GiB | resident layers | step graphs "
        "| loss first -> last | warnings |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    auto = {_row_key(r): r["tokens_per_s"] for r in report["runs"] if r.get("variant", "auto") == "auto"}
    for r in report["runs"]:
        graphs = "on" if "step_graphs" in r["switches_on"] else "off"
        graphs = "no verdict" if "trying" in (r["step_graphs"] or "") else graphs
        loss = f"{r['first_loss']:.2f} -> {r['final_loss']:.3f}" if r["final_loss"] is not None else r["outcome"]
        base = auto.get(_row_key(r))
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base and r["tokens_per_s"] else "-"
        speed = f"{r['tokens_per_s']:,}" if r["tokens_per_s"] else "-"
        lines.append(
            f"| {r['shape']} | {r['tokens']:,} | {r['cap_gib'] or '-'} | {r.get('variant', 'auto')} | "
            f"{speed} | {ratio} | {r['ms_per_step'] or '-'} | {r['peak_gib']} | "
            f"{r['resident_layers']} | {graphs} | {loss} | {len(r['warnings'])} |"
        )
    notes = report.get("notes", [])
    return "\n".join([*lines, "", *notes, ""]) if notes else "\n".join([*lines, ""])


def _peak_words(runs: list[dict[str, Any]]) -> list[str]:
    if any("true_peak_gib" in r for r in runs):
        return ["largest per-step true peak the run reports: reserved memory, step graphs' pool included."]
    return [
        "largest per-step peak of allocated memory the run reports (step graphs' pool memory between replays is not",
        "counted there).",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-3.1-8b,qwen3-8b", help="comma-separated QLoRA bench shapes")
    parser.add_argument("--caps", default="8,12,16,24", help="allocator caps in GiB (0: none)")
    parser.add_argument("--tokens", type=int, default=4096, help="row length")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument(
        "--planned-steps",
        dest="planned",
        type=int,
        help="configure each run for this many steps and stop it after --steps (e.g. 400: a long run's choices; "
        "a run configured for 40 steps does not compile, as compiling would not pay back)",
    )
    parser.add_argument("--rows", type=int, default=64, help="rows in the dataset")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunedeck-train-bench"), help="model folders, data")
    parser.add_argument("--logs", type=Path, help="each run's stdout/stderr (default: WORK/logs)")
    parser.add_argument("--from-logs", type=Path, help="rebuild the report from a run's logs, running nothing")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument(
        "--off",
        action="append",
        default=[],
        metavar="SWITCH",
        help="also run each row with this speed switch off (e.g. fp8_base), right after the automatic run",
    )
    parser.add_argument(
        "--on",
        action="append",
        default=[],
        metavar="SWITCH",
        help="also run each row with this speed switch on (e.g. step_graphs), right after the automatic run",
    )
    parser.add_argument("--tiny", action="store_true", help="two narrow layers of each shape (a dry run)")
    parser.add_argument("--gpu", help="the GPU's name for a report rebuilt from logs (default: this machine's)")
    parser.add_argument("--date", help="the runs' date for a report rebuilt from logs (default: today)")
    parser.add_argument("--versions", help="the libraries' versions for a report rebuilt from logs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/qlora_train.json"), help="JSON (+ .md)")
    return parser.parse_args(argv)


LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")


def environment() -> dict[str, str]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "versions": library_versions()}


def library_versions() -> str:
    """The training libraries' versions, those installed (bitsandbytes is absent on a CPU-only machine)."""
    found = []
    for name in LIBRARIES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def _row_key(record: dict[str, Any]) -> tuple[str, int, float | None]:
    return record["shape"], record["tokens"], record["cap_gib"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_logs:
        runs = from_logs(args.from_logs)
    else:
        logs = args.logs or args.work / "logs"
        for folder in (args.work, logs):
            folder.mkdir(parents=True, exist_ok=True)
        data = args.work / f"rows_{args.tokens}.jsonl"
        write_rows(data, args.rows, words=args.tokens // 3 + 1)
        runs = []
        for shape in args.shapes.split(","):
            folder = args.work / shape
            if not (folder / "config.json").exists():
                build_model_folder(shape, folder, tiny=args.tiny)
            for cap in (float(c) for c in args.caps.split(",")):
                variants = ["auto", *(f"auto-{s}" for s in args.off), *(f"auto+{s}" for s in args.on)]
                for variant in variants:
                    record = run(shape, folder, data, args.tokens, cap or None, args.steps, logs, variant, args.planned)
                    runs.append(record)
                    print(json.dumps(runs[-1]), flush=True)
    given = {"gpu": args.gpu, "date": args.date, "versions": args.versions}
    report = {
        **environment(),
        **{k: v for k, v in given.items() if v},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": runs,
    }
    report["notes"] = args.note
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
