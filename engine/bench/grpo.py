"""GRPO through TRL's GRPOTrainer, as its users run it, against ``tunedeck train --method grpo``: ``tunedeck bench
--grpo``.

Both sides train the same random-init model folder of a real shape (engine.bench.model_folder; Qwen3-0.6B by
default, the demo model's tokenizer) on the same JSONL file of prompts, with the same reward (1 where the answer
holds a digit: TuneDeck's ``regex:\\d`` and the same test as a TRL reward function), each in a fresh process with the
parent's environment less any allocator setting, one after the other:

- ``trl``: stock TRL: ``GRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=load_dataset("json",
  ...), processing_class=tokenizer, peft_config=LoraConfig(...))``, the model loaded in bf16; every prompt's group
  sampled and trained in one batch (``per_device_train_batch_size`` = prompts × group), transformers' ``generate``
  (no vLLM server: a hobbyist's one GPU) and GRPOConfig's own defaults for everything else: bf16, gradient
  checkpointing on, sdpa attention;
- ``tunedeck``: ``tunedeck train --method grpo`` (``python -m app train``, the installed command's entry point), every
  speed switch automatic.

Where memory is plenty (an H200), TuneDeck's automatic choice is no checkpointing while TRL's default recomputes, so
``trl-no_ckpt`` (TRL with ``gradient_checkpointing=False``) and ``tunedeck+standard_ckpt`` (``--checkpointing
standard``) compare like with like.

The sides share the LoRA settings (r16, alpha 32, no dropout, every linear layer but the output head), the group
size, prompts a step, sampling temperature, most new tokens, learning rate and schedule, loss (TRL's default
``dapo``), no KL penalty (TRL's default beta 0) and seed. Each step samples a new group (one optimizer step a
sampling, both sides' default). Three rates:

- **step tokens/s**: the prompt and answer tokens a step trains on (TRL's ``num_tokens``; TuneDeck's step
  ``tokens``) over the wall-clock time of the steps after ``--warmup``, sampling included;
- **generation tokens/s**: answer tokens sampled over the time spent sampling (TRL: its generation call, timed in a
  subclass that only adds a clock and a synchronize around it; TuneDeck: its step's own figure);
- **update tokens/s**: the step's tokens over the rest of the step's time.

A random-init model rarely ends an answer early, so answers run near the most new tokens on both sides; the record
gives the mean answer length of each. Memory: the allocator's peak reserved memory (TuneDeck: its per-step true
peak), TRL's peak allocated memory, and the process's memory as NVML reports it (CUDA context included).

    tunedeck bench --grpo --out benchmarks/grpo_h200.json
    tunedeck bench --grpo --tiny --out artifacts/grpo/tiny.json     (two narrow layers, on a CPU too)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from engine.bench import gpu_environment, write_report
from engine.bench.model_folder import WORDS, build_model_folder
from engine.bench.trl_sides import (
    SIDES,
    add_child_arguments,
    checkpointing_text,
    chosen_sides,
    finished,
    measure_sides,
    memory_figures,
    number,
    recomputes,
    run_trl,
    run_tunedeck,
    side_records,
)

__all__ = ["Workload", "main", "summarize"]

GIB = 2**30
DIGIT = r"\d"
"""The reward's test on both sides: 1 where the answer holds a digit, else 0."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both sides train: the same settings reach TRL's GRPOConfig and ``tunedeck train``'s flags."""

    shape: str = "qwen3-0.6b"
    tiny: bool = False
    prompts: int = 256
    prompt_words: int = 24
    """About 3.8 demo-tokenizer tokens a word: prompts of ~90 tokens."""
    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    steps: int = 14
    warmup: int = 4
    lr: float = 1e-5
    warmup_steps: int = 0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 42

    @classmethod
    def tiny_cpu(cls, **changes: Any) -> Workload:
        """Two narrow layers, short prompts and answers, a few steps: a check of the bench itself, on a CPU."""
        settings: dict[str, Any] = dict(tiny=True, prompts=16, prompt_words=6, prompts_per_step=2, group_size=4,
                                        max_new_tokens=8, steps=3, warmup=1)  # fmt: skip
        return cls(**{**settings, **changes})


def write_prompts(path: Path, work: Workload) -> None:
    """``work.prompts`` rows of random words, each a ``prompt`` string."""
    rng = random.Random(work.seed)
    with path.open("w", encoding="utf-8") as out:
        for _ in range(work.prompts):
            words = " ".join(rng.choice(WORDS) + rng.choice("abcdefgh") for _ in range(work.prompt_words))
            out.write(json.dumps({"prompt": words + "\n"}) + "\n")


def has_digit(text: str) -> float:
    """The reward both sides score answers with."""
    return float(re.search(DIGIT, text) is not None)


# --- the TRL side (a child process) -------------------------------------------------------------------------------


def trl_child(args: argparse.Namespace) -> int:
    """Stock TRL on the prompts; its steps, sampling times and memory go to ``args.result`` as JSON."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    work = Workload(**json.loads(args.workload))
    cuda = torch.cuda.is_available()
    clock: list[float] = []
    sampled: list[tuple[float, int]] = []  # (seconds, answer tokens) of each generation call

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    class StepClock(TrainerCallback):
        """The wall clock at each step's end, once the GPU has finished it."""

        def on_step_end(self, *_: Any, **__: Any) -> None:
            synchronize()
            clock.append(time.perf_counter())

    class TimedGeneration(GRPOTrainer):
        """TRL's trainer with a clock around its generation call, nothing else changed."""

        def _generate_single_turn(self, *positional: Any, **named: Any) -> Any:
            synchronize()
            started = time.perf_counter()
            result = super()._generate_single_turn(*positional, **named)  # type: ignore[no-untyped-call]
            synchronize()
            sampled.append((time.perf_counter() - started, sum(len(ids) for ids in result[0])))
            return result

    def digit(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return [has_digit(text) for text in completions]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    config = GRPOConfig(
        output_dir=str(args.work / "trl"),
        per_device_train_batch_size=work.prompts_per_step * work.group_size,
        num_generations=work.group_size,
        max_completion_length=work.max_new_tokens,
        temperature=work.temperature,
        max_steps=work.steps,
        learning_rate=work.lr,
        lr_scheduler_type="cosine",
        warmup_steps=work.warmup_steps,
        seed=work.seed,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=not args.no_checkpointing,  # GRPOConfig's default: on
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    lora = LoraConfig(r=work.lora_rank, lora_alpha=int(work.lora_alpha), lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    dataset = load_dataset("json", data_files=str(args.data), split="train")
    trainer = TimedGeneration(model=model, reward_funcs=[digit], args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[StepClock()])  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result = {
        "steps": trl_steps(trainer.state.log_history, clock, sampled),
        "settings": trl_settings(trainer),
        **memory_figures(torch.device("cuda" if cuda else "cpu")),
    }
    args.result.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def trl_steps(
    log_history: list[dict[str, Any]], clock: list[float], sampled: list[tuple[float, int]]
) -> list[dict[str, Any]]:
    """Each step's loss, tokens (the change in TRL's running ``num_tokens``), reward, answer length, sampling time and
    end time (one generation call a step: one optimizer step a sampling)."""
    logged = [entry for entry in log_history if "loss" in entry and "num_tokens" in entry]
    steps, before = [], 0.0
    for entry, ended, (seconds, answer_tokens) in zip(logged, clock, sampled, strict=False):
        steps.append({
            "step": entry["step"], "loss": entry["loss"], "tokens": int(entry["num_tokens"] - before),
            "reward_mean": entry.get("reward"), "completion_length": entry.get("completions/mean_length"),
            "generation_s": seconds, "answer_tokens": answer_tokens, "ended": ended,
        })  # fmt: skip
        before = entry["num_tokens"]
    return steps


def trl_settings(trainer: Any) -> dict[str, Any]:
    """What the stock run used, read back from the trainer."""
    args, model = trainer.args, trainer.model
    return {
        "gradient_checkpointing": args.gradient_checkpointing,
        "bf16": args.bf16,
        "optim": str(args.optim),
        "loss_type": args.loss_type,
        "beta": args.beta,
        "use_vllm": args.use_vllm,
        "generation_batch_size": args.generation_batch_size,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }


# --- the TuneDeck side --------------------------------------------------------------------------------------------


def tunedeck_command(model: Path, data: Path, output: Path, work: Workload, extra: list[str]) -> list[str]:
    """``tunedeck train --method grpo`` with the shared settings and ``extra``; every other speed switch automatic."""
    return [
        sys.executable, "-m", "app", "train", "--method", "grpo", "--model", str(model), "--data", str(data),
        "--reward", f"regex:{DIGIT}", "--group-size", str(work.group_size),
        "--grad-accum", str(work.prompts_per_step), "--max-new-tokens", str(work.max_new_tokens),
        "--temperature", str(work.temperature), "--max-steps", str(work.steps), "--eval-fraction", "0",
        "--no-keep-knowledge", "--lr", str(work.lr), "--warmup-steps", str(work.warmup_steps),
        "--lora-rank", str(work.lora_rank), "--lora-alpha", str(work.lora_alpha), "--seed", str(work.seed),
        "--json", "--output", str(output), *extra,
    ]  # fmt: skip


def tunedeck_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TuneDeck's steps with the sampling time and answer tokens its own figures give."""
    out = []
    for step in steps:
        answers = (step.get("completion_length") or 0.0) * step["answers"]
        rate = step.get("generation_tokens_per_s")
        out.append({**step, "answer_tokens": round(answers), "generation_s": answers / rate if rate else None})
    return out


# --- the report ---------------------------------------------------------------------------------------------------


def summarize(side: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A side's figures from its steps after ``warmup``: step, generation and update tokens/s by the wall clock."""
    steps = side.get("steps", [])
    timed = steps[warmup:]
    figures: dict[str, Any] = {"steps": len(steps), "tokens_per_s": None, "ms_per_step": None}
    if timed and warmup >= 1:
        seconds = timed[-1]["ended"] - steps[warmup - 1]["ended"]
        tokens = sum(s["tokens"] for s in timed)
        figures.update(tokens_per_s=round(tokens / seconds, 1), ms_per_step=round(seconds / len(timed) * 1e3, 1),
                       tokens_per_step=round(tokens / len(timed)))  # fmt: skip
        sampling = [s["generation_s"] for s in timed if s.get("generation_s")]
        if len(sampling) == len(timed):
            answers = sum(s["answer_tokens"] for s in timed)
            figures.update(generation_tokens_per_s=round(answers / sum(sampling), 1),
                           update_tokens_per_s=round(tokens / max(seconds - sum(sampling), 1e-9), 1),
                           sampling_share=round(sum(sampling) / seconds, 3))  # fmt: skip
    if steps:
        lengths = [s["completion_length"] for s in timed if s.get("completion_length") is not None]
        rewards = [s["reward_mean"] for s in timed if s.get("reward_mean") is not None]
        figures.update(
            first_loss=steps[0]["loss"],
            mean_answer_tokens=round(statistics.mean(lengths), 1) if lengths else None,
            mean_timed_reward=round(statistics.mean(rewards), 3) if rewards else None,
        )
    for key in ("peak_reserved_bytes", "peak_allocated_bytes", "driver_bytes"):
        value = side.get(key)
        figures[key.replace("_bytes", "_gib")] = round(value / GIB, 2) if value else None
    return figures


def environment() -> dict[str, str]:
    return gpu_environment(("torch", "transformers", "peft", "trl", "accelerate", "datasets"))


def markdown(report: dict[str, Any]) -> str:
    work, env, rows, settings = report["workload"], report["environment"], report["sides"], report["settings"]
    trl = settings.get("trl", {})
    lines = [
        "# GRPO: TRL's GRPOTrainer against `tunedeck train --method grpo`: `tunedeck bench --grpo`",
        "",
        f"GPU: {env['gpu']}, {env['date']}, {env['versions']}",
        "",
        f"Model `{work['shape']}`{' (tiny)' if work['tiny'] else ''}, random init, bf16 on a GPU; {work['prompts']} "
        f"prompts of {work['prompt_words']} random words (mean {report['mean_prompt_tokens']:.0f} tokens); "
        f"{work['prompts_per_step']} prompts a step × {work['group_size']} answers, up to {work['max_new_tokens']} "
        f"new tokens at temperature {work['temperature']:g}; reward 1 where the answer holds a digit; LoRA "
        f"r{work['lora_rank']} alpha {work['lora_alpha']:g} on every linear layer; lr {work['lr']:g}; "
        f"{work['steps']} steps, timed after step {work['warmup']}. TRL as documented: "
        f"{', '.join(f'{k} {v}' for k, v in trl.items())}. TuneDeck: `tunedeck train --method grpo`, every switch "
        "automatic but the checkpointing a row names. Each row a fresh process. x TRL: against the `trl` row.",
        "",
        *like_for_like(report),
        "| side | checkpointing | step tokens/s | x TRL | generation tokens/s | update tokens/s | sampling share "
        "| ms/step | mean answer tokens | peak reserved GiB | peak allocated GiB | NVML GiB | switches on |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        ratio = report["ratios"].get(name)
        side = settings.get(name, {})
        lines.append(
            f"| {name} | {checkpointing_text(side)} | {number(r['tokens_per_s'])} | "
            f"{f'{ratio:.2f}' if ratio else '–'} | "
            f"{number(r.get('generation_tokens_per_s'))} | {number(r.get('update_tokens_per_s'))} | "
            f"{_share(r.get('sampling_share'))} | {r['ms_per_step'] or '–'} | {r.get('mean_answer_tokens') or '–'} | "
            f"{r['peak_reserved_gib'] or '–'} | {r['peak_allocated_gib'] or '–'} | {r['driver_gib'] or '–'} | "
            f"{', '.join(side.get('switches_on', [])) or '–'} |"
        )
    lines += ["", *[f"* {note}" for note in report["notes"]]]
    return "\n".join(lines) + "\n"


def like_for_like(report: dict[str, Any]) -> list[str]:
    """TuneDeck against TRL with the same choice of recompute on both sides, for each such pair measured."""
    rows, settings = report["sides"], report["settings"]
    lines = []
    for recompute, words in ((True, "with recompute on both sides"), (False, "without recompute on both sides")):
        trl = [n for n in rows if n.startswith("trl") and recomputes(settings.get(n, {})) is recompute]
        ours = [n for n in rows if n.startswith("tunedeck") and recomputes(settings.get(n, {})) is recompute]
        for theirs, mine in zip(trl, ours, strict=False):
            a, b = rows[theirs], rows[mine]
            if a["tokens_per_s"] and b["tokens_per_s"]:
                lines.append(
                    f"* **{words}: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x** TRL a step "
                    f"({number(b['tokens_per_s'])} against {number(a['tokens_per_s'])} tokens/s; generation "
                    f"{_ratio(b.get('generation_tokens_per_s'), a.get('generation_tokens_per_s'))}, update "
                    f"{_ratio(b.get('update_tokens_per_s'), a.get('update_tokens_per_s'))}; `{mine}` against "
                    f"`{theirs}`)"
                )
    return ["Like for like:", "", *lines, ""] if lines else []


def _ratio(mine: float | None, theirs: float | None) -> str:
    return f"{mine / theirs:.2f}x" if mine and theirs else "–"


def _share(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "–"


def notes(sides: dict[str, dict[str, Any]], max_new_tokens: int) -> list[str]:
    """What a reader checks first: every side finished, and the answers were about as long on each side."""
    out = [f"{name}: {side['outcome']}" for name, side in sides.items() if side["outcome"] != "RunFinished"]
    lengths = {name: side["figures"].get("mean_answer_tokens") for name, side in sides.items()}
    listed = ", ".join(f"{value} ({name})" for name, value in lengths.items() if value)
    if listed:
        out.append(f"mean answer tokens in the timed steps: {listed} (of {max_new_tokens} at most)")
    return out


# --- the parent ---------------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, work: Workload) -> tuple[Path, Path, float]:
    """The model folder and prompts (made once in ``--work``) and the prompts' mean tokens."""
    from tokenizers import Tokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    folder = args.work / (work.shape + ("-tiny" if work.tiny else ""))
    if not (folder / "config.json").exists():
        build_model_folder(work.shape, folder, tiny=work.tiny)
    data = args.work / f"prompts_{work.prompts}.jsonl"
    write_prompts(data, work)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rows = [json.loads(line)["prompt"] for line in data.read_text(encoding="utf-8").splitlines()]
    mean = statistics.mean(len(tokenizer.encode(row, add_special_tokens=False).ids) for row in rows)
    return folder, data, mean


def run_side(name: str, args: argparse.Namespace, work: Workload, prepared: tuple[Path, Path, float]) -> Any:
    import torch

    folder, data, _ = prepared
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if name.startswith("trl"):
        return run_trl("engine.bench.grpo", args.work, work, folder, data, name, SIDES[name])
    command = tunedeck_command(folder, data, args.work / "runs", work, SIDES[name])
    side = run_tunedeck(command, logs / f"{name}.log", torch.cuda.is_available())
    answers = work.prompts_per_step * work.group_size
    side["steps"] = tunedeck_steps([{**step, "answers": answers} for step in side["steps"]])
    return side


def parent_main(args: argparse.Namespace) -> int:
    work = workload(args)
    names = chosen_sides(args.sides, SIDES, "--grpo")
    prepared = prepare(args, work)
    sides = measure_sides(
        names, lambda name: run_side(name, args, work, prepared), lambda side: summarize(side, work.warmup)
    )
    report = {
        "environment": environment(),
        "workload": dataclasses.asdict(work),
        "mean_prompt_tokens": prepared[2],
        **side_records(sides),
        "notes": notes(sides, work.max_new_tokens),
        "steps": {name: side["steps"] for name, side in sides.items()},
    }
    write_report(report, args.out, markdown(report))
    return finished(sides)


def workload(args: argparse.Namespace) -> Workload:
    keys = ("shape", "prompts", "prompts_per_step", "group_size", "max_new_tokens", "steps", "warmup")
    changes = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    return Workload.tiny_cpu(**changes) if args.tiny else Workload(**changes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tunedeck bench --grpo", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", help="model shape (default qwen3-0.6b; llama-3.2-1b works too)")
    parser.add_argument("--tiny", action="store_true", help="two narrow layers, short prompts, 3 steps (on a CPU)")
    parser.add_argument("--prompts", type=int, help="prompts in the file (default 256)")
    parser.add_argument("--prompts-per-step", type=int, help="prompts a step (default 4)")
    parser.add_argument("--group-size", type=int, help="answers sampled for each prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, help="most tokens an answer has (default 128)")
    parser.add_argument("--steps", type=int, help="steps each side runs (default 14)")
    parser.add_argument("--warmup", type=int, help="steps left out of the timing (default 4)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--work", type=Path, default=Path("artifacts/grpo"), help="model folder, prompts, runs, logs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/grpo_h200.json"))
    add_child_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side == "trl":
        return trl_child(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
