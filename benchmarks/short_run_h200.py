"""Time to result for short runs: ``tunedeck train`` on the SmolLM2-135M shape, 70 chats in 512-token rows.

A hobbyist's run is short: a 20-step run used to spend 35-40 s compiling layer regions, capturing step graphs and
timing them, to train for 0.2 s. This record runs the product as a user starts it, each run a fresh
``python -m engine.cli train`` process with a clean environment (no allocator or compiler settings; its own
``TUNEDECK_HOME`` and temp folder, so no cache from outside the record is found):

* (a) 20 steps, every speed switch off;
* (b) 20 steps, every switch automatic, in a fresh data folder (cold compile cache, no stored decisions);
* (c) the same again in the same data folder (warm compile cache, the decisions (b) stored);
* (d) with ``--long``: 210 steps all off and automatic (fresh data folder), as a reference.

For each: the process's wall time, the time from its start to the first step event, to the first fast step
(within :data:`FAST_SHARE` of the settled step time) and from the run's start event to it, the run's own step times,
and what the fused-kernel and step-graph switches chose. Writes the JSON and a Markdown table beside it with
automatic / all-off ratios. The model is random-init (the GPU machine has no hub) with the demo tokenizer.

    python benchmarks/short_run_h200.py --out benchmarks/short_run_h200.json [--long]
    python benchmarks/short_run_h200.py --tiny --work /tmp/x --out /tmp/x/short.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, get_args, get_type_hints

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
WORDS = ("alpha", "river", "stone", "light", "seven", "under", "green", "table", "music", "north", "cloud", "paper")
SMOLLM2_135M = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
}  # fmt: skip
"""SmolLM2-135M's published config (the fields that shape training); its vocabulary covers the demo tokenizer's."""
TINY = {**SMOLLM2_135M, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 1024}  # fmt: skip
FAST_SHARE = 1.5
"""A step is fast when it took at most this multiple of the settled step time (median of the run's last half)."""
ENVIRONMENT = ("PATH", "HOME", "LANG", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV")
"""What a run keeps of this process's environment: enough to find Python, its packages and the GPU."""
OFF_CHOICES = {"checkpointing": "none", "moe_routing": "stock"}
"""The switches that are not on/off/automatic, set to their stock choice in the all-off runs."""
BUDGET_S = 345
"""The record's runs together: a run is stopped, and those after it skipped, once this much time has passed (the
record's GPU time stays under 6 minutes with the model folder built first)."""


@dataclasses.dataclass(frozen=True)
class Planned:
    """One run of the record: its switches (``off`` or ``auto``), steps and data folder (runs that share a folder
    share its compile cache and stored decisions)."""

    key: str
    variant: str
    steps: int
    home: str
    cache: str = ""

    @property
    def label(self) -> str:
        switches = "all off" if self.variant == "off" else "automatic"
        return f"{self.key}: {self.steps} steps, {switches}" + (f", {self.cache} cache" if self.cache else "")


def plan(long: bool, tiny: bool = False) -> list[Planned]:
    """The record's runs in order; ``tiny``: 3 and 6 steps instead of 20 and 210."""
    short, longer = (3, 6) if tiny else (20, 210)
    runs = [
        Planned("a", "off", short, "off"),
        Planned("b", "auto", short, "auto", "cold"),
        Planned("c", "auto", short, "auto", "warm"),
    ]
    if long:
        runs += [Planned("d", "off", longer, "off-long"), Planned("d", "auto", longer, "auto-long", "cold")]
    return runs


# --- inputs -----------------------------------------------------------------------------------------------------


def build_model_folder(folder: Path, tiny: bool = False) -> None:
    """A loadable model folder: the SmolLM2-135M shape (``tiny``: 2 narrow layers), random bf16 weights, the demo
    model's tokenizer (ChatML, eos 2, pad 3)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**(TINY if tiny else SMOLLM2_135M), bos_token_id=None, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(ROOT / "resources" / "demo" / "model" / file, folder / file)


def write_chats(path: Path, count: int = 70, seed: int = 0) -> None:
    """``count`` two-turn chats of 15-35 random words a turn: about 150 demo-tokenizer tokens each, so 70 of them
    pack into about 21 rows of 512 tokens."""
    rng = random.Random(seed)

    def words() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 35)))

    with path.open("w") as out:
        for _ in range(count):
            chat = [{"role": "user", "content": words()}, {"role": "assistant", "content": words()}]
            out.write(json.dumps({"messages": chat}) + "\n")


def off_flags() -> list[str]:
    """``tunedeck train`` flags that turn every speed switch off (read from the config, so new switches join)."""
    from engine.cli.flags import flag_name
    from engine.config import SpeedConfig

    hints = get_type_hints(SpeedConfig)
    flags: list[str] = []
    for spec in dataclasses.fields(SpeedConfig):
        if spec.name in OFF_CHOICES:
            flags += [flag_name(spec), OFF_CHOICES[spec.name]]
        elif bool in get_args(hints[spec.name]):
            flags.append("--no-" + flag_name(spec).removeprefix("--"))
    return flags


def train_command(model: Path, data: Path, steps: int, output: Path, variant: str, tiny: bool) -> list[str]:
    command = [
        sys.executable, "-m", "engine.cli", "train", "--model", str(model), "--data", str(data),
        "--max-seq-len", "512", "--tokens-per-batch", "512", "--max-steps", str(steps), "--json",
        "--output", str(output),
    ]  # fmt: skip
    if tiny:
        command += ["--device", "cpu"]
    return command + (off_flags() if variant == "off" else [])


def clean_environment(home: Path) -> dict[str, str]:
    """A user's environment: no allocator or compiler settings, this record's data folder and temp folder."""
    temp = home / "tmp"
    temp.mkdir(parents=True, exist_ok=True)
    kept = {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}
    return {**kept, "TUNEDECK_HOME": str(home), "TMPDIR": str(temp), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


# --- one run ----------------------------------------------------------------------------------------------------


def timed_lines(command: list[str], env: dict[str, str], err: Path, timeout_s: float) -> tuple[list, float, int]:
    """Run ``command``; ([(seconds since start, stdout line)], wall seconds, return code). A run still going after
    ``timeout_s`` is killed (return code -9)."""
    started = time.perf_counter()
    lines: list[tuple[float, str]] = []
    with err.open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        watchdog = threading.Timer(max(1.0, timeout_s), process.kill)
        watchdog.start()
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.perf_counter() - started, line.rstrip("\n")))
        code = process.wait()
        watchdog.cancel()
    return lines, time.perf_counter() - started, code


def events_of(lines: list[tuple[float, str]]) -> list[tuple[float, dict[str, Any]]]:
    """The run's JSON events with the time each arrived; other lines skipped."""
    events = []
    for at, line in lines:
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append((at, json.loads(line)))
    return events


def summary(events: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """One run's figures from its timed events (see the module docstring)."""
    steps = [(at, e) for at, e in events if e.get("kind") == "StepMetrics"]
    start = next(((at, e) for at, e in events if e.get("kind") == "RunStarted"), None)
    started = start[0] if start is not None else None
    finished = next((e for _, e in events if e.get("kind") in ("RunFinished", "RunFailed")), {})
    states = [e["state"] for _, e in events if e.get("kind") == "SpeedChanged"]
    times = [float(e["step_time_s"]) for _, e in steps]
    settled = statistics.median(times[len(times) // 2 :]) if times else None
    fast = next((at for (at, _), t in zip(steps, times, strict=True) if settled and t <= FAST_SHARE * settled), None)
    state = states[-1] if states else {}
    return {
        "steps": len(steps),
        "train_rows": start[1].get("train_rows") if start is not None else None,
        "outcome": finished.get("kind", "no end event"),
        "run_wall_s": _round(finished.get("wall_time_s")),
        "first_step_s": _round(steps[0][0] if steps else None),
        "fast_step_s": _round(fast),
        "fast_after_start_s": _round(fast - started if fast is not None and started is not None else None),
        "settled_step_ms": _round(settled * 1e3 if settled else None),
        "step_ms": [round(t * 1e3, 1) for t in times],
        "first_loss": steps[0][1].get("loss") if steps else None,
        "final_loss": steps[-1][1].get("loss") if steps else None,
        "fused_kernels": state.get("fused_kernels", {}),
        "step_graphs": state.get("step_graphs", {}),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 2)


def run(planned: Planned, model: Path, data: Path, work: Path, tiny: bool, timeout_s: float) -> dict[str, Any]:
    """One ``tunedeck train`` process, stopped after ``timeout_s``; its stdout and stderr kept under ``work/logs``."""
    home, logs = work / "homes" / planned.home, work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stem = f"{planned.key}_{planned.variant}_{planned.steps}"
    command = train_command(model, data, planned.steps, work / "runs", planned.variant, tiny)
    lines, wall, code = timed_lines(command, clean_environment(home), logs / f"{stem}.err", timeout_s)
    (logs / f"{stem}.log").write_text("\n".join(f"{at:.3f} {line}" for at, line in lines) + "\n")
    record = {"label": planned.label, "variant": planned.variant, "steps_asked": planned.steps, "home": planned.home}
    return {**record, "wall_s": round(wall, 2), "returncode": code, **summary(events_of(lines))}


# --- report -----------------------------------------------------------------------------------------------------


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each automatic run against the all-off run of the same length: wall, first-step and fast-step times."""
    off = {r["steps_asked"]: r for r in runs if r["variant"] == "off"}
    rows = []
    for r in runs:
        base = off.get(r["steps_asked"])
        if r["variant"] != "auto" or base is None:
            continue
        rows.append({"label": r["label"], **{key: _ratio(r.get(key), base.get(key)) for key in RATIO_KEYS}})
    return rows


RATIO_KEYS = ("wall_s", "first_step_s", "fast_step_s", "settled_step_ms")


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 2) if value is not None and base else None


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Time to result for short runs: `tunedeck train`, SmolLM2-135M shape, 70 chats, 512-token rows",
        "",
        f"GPU: {report.get('gpu', '?')}, {report.get('date', '?')}, {report.get('versions', '')}",
        "",
        "Each run a fresh process with a clean environment. Wall: the whole process. First step: from the process's",
        "start to its first step event. Fast step: to the first step within "
        f"{FAST_SHARE}x of the settled step time (the median",
        "of the run's last half), from the process's start and from the run's start event. Run: the run's own wall.",
        "",
        "| run | wall s | run s | first step s | fast step s | fast after start s | settled ms | fused kernels "
        "| step graphs |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['label']} | {r['wall_s']} | {r['run_wall_s']} | {r['first_step_s']} | {r['fast_step_s']} | "
            f"{r['fast_after_start_s']} | {r['settled_step_ms']} | {_on(r['fused_kernels'])} | "
            f"{_on(r['step_graphs'])} |"
        )
    lines += ["", "Automatic / all off (same number of steps):", ""]
    lines += ["| run | wall | first step | fast step | settled |", "|---|---:|---:|---:|---:|"]
    for row in report["ratios"]:
        lines.append(f"| {row['label']} | " + " | ".join(str(row[key]) for key in RATIO_KEYS) + " |")
    lines += ["", "What the automatic runs chose:", ""]
    for r in report["runs"]:
        if r["variant"] == "auto":
            for name in ("fused_kernels", "step_graphs"):
                lines.append(f"* {r['label']}, {name.replace('_', ' ')}: {r[name].get('reason', '-')}")
    notes = report.get("notes", [])
    return "\n".join([*lines, "", *notes, ""]) if notes else "\n".join([*lines, ""])


def _on(state: dict[str, Any]) -> str:
    return "-" if "on" not in state else ("on" if state["on"] else "off")


def environment() -> dict[str, str]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    versions = []
    for name in ("torch", "transformers", "peft"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{name} {importlib.metadata.version(name)}")
    return {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "versions": ", ".join(versions)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="also the 210-step runs, all off and automatic")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU, 3 steps a run (a smoke run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunedeck-short-run"), help="model, data, homes, logs")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/short_run_h200.json"), help="JSON (+ .md)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.work.exists():
        shutil.rmtree(args.work)  # fresh data folders: the cold runs must find no cache
    model, data = args.work / "smollm2-135m-shape", args.work / "chats.jsonl"
    build_model_folder(model, tiny=args.tiny)
    write_chats(data)
    started, runs = time.perf_counter(), []
    for planned in plan(args.long, args.tiny):
        if time.perf_counter() - started > BUDGET_S - 10:
            print(f"skipped (time budget): {planned.label}", flush=True)
            continue
        left = BUDGET_S - (time.perf_counter() - started)
        runs.append(run(planned, model, data, args.work, args.tiny, timeout_s=left))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "step_ms"}), flush=True)
    report = {**environment(), "settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    report["ratios"], report["notes"] = ratios(runs), args.note
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
