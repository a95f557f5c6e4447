"""DPO through TRL's DPOTrainer, as its users run it, against ``tunedeck train --method dpo``: ``tunedeck bench --dpo``.

Both sides train the same random-init model folder of a real shape (engine.bench.model_folder; Qwen3-0.6B by
default, the demo model's tokenizer) on the same JSONL file of synthetic prompt/chosen/rejected pairs (prompts of
about 200 tokens, answers of 150-300), each in a fresh process with the parent's environment less any allocator
setting, one after the other:

- ``trl``: stock TRL: ``DPOTrainer(model, args=DPOConfig(...), train_dataset=load_dataset("json", ...),
  processing_class=tokenizer, peft_config=LoraConfig(...))``, the model loaded in bf16, ``ref_model`` None (the
  reference is the model with the adapter switched off), a fixed number of pairs a batch, and DPOConfig's own
  defaults for everything else: bf16, gradient checkpointing on, sdpa attention, padding to the batch's longest row;
- ``tunedeck``: ``tunedeck train --method dpo`` (``python -m app train``, the installed command's entry point), every
  speed switch automatic, packed rows of a token budget that holds about as many pairs as TRL's batch.

Where memory is plenty (an H200), TuneDeck's automatic choice is no checkpointing while TRL's default recomputes, so
three more rows compare like with like: ``trl-no_ckpt`` (TRL with ``gradient_checkpointing=False``), and
``tunedeck+standard_ckpt`` / ``tunedeck+offloaded_ckpt`` (``--checkpointing standard`` / ``offloaded``).

The two share the LoRA settings (TuneDeck's defaults: r16, alpha 32, no dropout, every linear layer but the output
head), beta, loss, learning rate and its schedule (TuneDeck's defaults: 2e-4, 10 warm-up steps, cosine), seed and
gradient clipping. Tokens are the real tokens each step feeds the model, counted the same way on both sides: a pair
counts its prompt twice (once before each answer) and both answers with their end-of-text token, no padding (TRL's
``num_tokens``, the attention mask's sum; TuneDeck's step ``tokens``). Tokens/s is the tokens of the steps after
``--warmup`` over the wall-clock time from the end of step ``--warmup`` to the end of the last step (TRL: a
synchronized clock at each step's end; TuneDeck: when its ``--json`` step event reaches the parent). The timed steps
stay within TuneDeck's first pass over the pairs, where it still runs the reference forward pass that later passes
take from its cache, so both sides do the same work. Memory: the allocator's peak reserved memory (TuneDeck: its
per-step true peak), TRL's peak allocated memory, and the process's memory as NVML reports it (CUDA context included).

The first step's loss is ln 2 on both sides: a new adapter's B matrices are zero, so the policy is the reference.
``tests/test_dpo_trl.py`` and ``tests/test_dpo_gpu.py`` hold the losses of later steps to TRL's, step by step.

    tunedeck bench --dpo --out benchmarks/dpo_h200.json
    tunedeck bench --dpo --tiny --out artifacts/dpo/tiny.json     (two narrow layers, on a CPU too)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from engine.bench import gpu_environment, trl_sides, write_report
from engine.bench.model_folder import WORDS, build_model_folder
from engine.bench.trl_sides import (
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
SIDES: dict[str, list[str]] = {**trl_sides.SIDES, "tunedeck+offloaded_ckpt": ["--checkpointing", "offloaded"]}
"""The shared sides (engine.bench.trl_sides.SIDES), and TuneDeck with offloaded recompute."""
LN2 = math.log(2)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both sides train: the same settings reach TRL's DPOConfig and ``tunedeck train``'s flags."""

    shape: str = "qwen3-0.6b"
    tiny: bool = False
    pairs: int = 640
    prompt_words: int = 52
    answer_words: tuple[int, int] = (40, 80)
    """About 3.8 demo-tokenizer tokens a word: prompts of ~200 tokens, answers of ~150-300."""
    batch_pairs: int = 8
    steps: int = 50
    warmup: int = 10
    beta: float = 0.1
    loss: str = "sigmoid"
    lr: float = 2e-4
    warmup_steps: int = 10
    lora_rank: int = 16
    lora_alpha: float = 32.0
    seed: int = 42

    @classmethod
    def tiny_cpu(cls, **changes: Any) -> Workload:
        """Two narrow layers, short pairs and a few steps: a check of the bench itself, on a CPU."""
        settings: dict[str, Any] = dict(tiny=True, pairs=24, prompt_words=6, answer_words=(4, 8), batch_pairs=2,
                                        steps=3, warmup=1, warmup_steps=1)  # fmt: skip
        return cls(**{**settings, **changes})


# --- the pairs ----------------------------------------------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + rng.choice("abcdefgh") for _ in range(words))


def write_pairs(path: Path, work: Workload) -> None:
    """``work.pairs`` prompt/chosen/rejected rows of random words, each answer's length drawn on its own."""
    rng = random.Random(work.seed)
    low, high = work.answer_words
    with path.open("w", encoding="utf-8") as out:
        for _ in range(work.pairs):
            row = {
                "prompt": _text(rng, work.prompt_words) + "\n",
                "chosen": _text(rng, rng.randint(low, high)),
                "rejected": _text(rng, rng.randint(low, high)),
            }
            out.write(json.dumps(row) + "\n")


def mean_pair_tokens(folder: Path, data: Path) -> float:
    """The mean tokens a pair feeds the model: its prompt twice, each answer with an end-of-text token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    sizes = []
    for line in data.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        sizes.append(2 * count(row["prompt"]) + count(row["chosen"]) + count(row["rejected"]) + 2)
    return statistics.mean(sizes)


# --- the TRL side (a child process) -------------------------------------------------------------------------------


def trl_child(args: argparse.Namespace) -> int:
    """Stock TRL on the pairs; its steps and memory go to ``args.result`` as JSON."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    settings = json.loads(args.workload)
    work = Workload(**{**settings, "answer_words": tuple(settings["answer_words"])})
    cuda = torch.cuda.is_available()
    clock: list[float] = []

    class StepClock(TrainerCallback):
        """The wall clock at each step's end, once the GPU has finished it."""

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            clock.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    config = DPOConfig(
        output_dir=str(args.work / "trl"),
        per_device_train_batch_size=work.batch_pairs,
        max_steps=work.steps,
        learning_rate=work.lr,
        lr_scheduler_type="cosine",
        warmup_steps=work.warmup_steps,
        beta=work.beta,
        loss_type=[work.loss],
        seed=work.seed,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=not args.no_checkpointing,  # DPOConfig's default: on
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    lora = LoraConfig(r=work.lora_rank, lora_alpha=int(work.lora_alpha), lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    dataset = load_dataset("json", data_files=str(args.data), split="train")
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora, callbacks=[StepClock()])  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result = {
        "steps": trl_steps(trainer.state.log_history, clock),
        "settings": trl_settings(trainer),
        **memory_figures(torch.device("cuda" if cuda else "cpu")),
    }
    args.result.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def trl_steps(log_history: list[dict[str, Any]], clock: list[float]) -> list[dict[str, Any]]:
    """Each step's loss, real tokens (the change in TRL's running ``num_tokens``), reward accuracy and end time."""
    logged = [entry for entry in log_history if "loss" in entry and "num_tokens" in entry]
    steps, before = [], 0.0
    for entry, ended in zip(logged, clock, strict=False):
        steps.append({"step": entry["step"], "loss": entry["loss"], "tokens": int(entry["num_tokens"] - before),
                      "reward_accuracy": entry.get("rewards/accuracies"), "ended": ended})  # fmt: skip
        before = entry["num_tokens"]
    return steps


def trl_settings(trainer: Any) -> dict[str, Any]:
    """What the stock run used, read back from the trainer."""
    args, model = trainer.args, trainer.model
    return {
        "gradient_checkpointing": args.gradient_checkpointing,
        "gradient_checkpointing_kwargs": args.gradient_checkpointing_kwargs,
        "bf16": args.bf16,
        "optim": str(args.optim),
        "max_length": args.max_length,
        "padding_free": args.padding_free,
        "precompute_ref_log_probs": args.precompute_ref_log_probs,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "reference": "adapter disabled" if trainer.ref_model is None else "separate model",
    }


# --- the TuneDeck side --------------------------------------------------------------------------------------------


def tunedeck_command(
    model: Path, data: Path, output: Path, work: Workload, tokens_per_batch: int, extra: list[str]
) -> list[str]:
    """``tunedeck train --method dpo`` with the shared settings and ``extra``; every other speed switch automatic."""
    return [
        sys.executable, "-m", "app", "train", "--method", "dpo", "--model", str(model), "--data", str(data),
        "--max-steps", str(work.steps), "--tokens-per-batch", str(tokens_per_batch), "--eval-fraction", "0",
        "--lr", str(work.lr), "--warmup-steps", str(work.warmup_steps), "--dpo-beta", str(work.beta),
        "--dpo-loss", work.loss, "--lora-rank", str(work.lora_rank), "--lora-alpha", str(work.lora_alpha),
        "--seed", str(work.seed), "--json", "--output", str(output), *extra,
    ]  # fmt: skip


# --- the report ---------------------------------------------------------------------------------------------------


def summarize(side: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A side's figures from its steps: tokens/s over the steps after ``warmup``, by the wall clock."""
    steps = side.get("steps", [])
    timed = steps[warmup:]
    figures: dict[str, Any] = {"steps": len(steps), "tokens_per_s": None, "ms_per_step": None}
    if timed and warmup >= 1:
        seconds = timed[-1]["ended"] - steps[warmup - 1]["ended"]
        tokens = sum(s["tokens"] for s in timed)
        figures.update(tokens_per_s=round(tokens / seconds, 1), ms_per_step=round(seconds / len(timed) * 1e3, 1),
                       tokens_per_step=round(tokens / len(timed)))  # fmt: skip
    if steps:
        accuracies = [s["reward_accuracy"] for s in timed if s.get("reward_accuracy") is not None]
        figures.update(
            first_loss=steps[0]["loss"],
            last_loss=steps[-1]["loss"],
            mean_timed_loss=statistics.mean(s["loss"] for s in timed) if timed else None,
            mean_timed_reward_accuracy=statistics.mean(accuracies) if accuracies else None,
        )
    if any("step_time_s" in s for s in timed):  # TuneDeck's own step times, and whether its cache was used
        figures["own_tokens_per_s"] = round(sum(s["tokens"] for s in timed) / sum(s["step_time_s"] for s in timed), 1)
        figures["timed_steps_after_first_pass"] = sum(1 for s in timed if s.get("epoch", 0) > 1)
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
        "# DPO: TRL's DPOTrainer against `tunedeck train --method dpo`: `tunedeck bench --dpo`",
        "",
        f"GPU: {env['gpu']}, {env['date']}, {env['versions']}",
        "",
        f"Model `{work['shape']}`{' (tiny)' if work['tiny'] else ''}, random init, bf16 on a GPU; {work['pairs']} "
        f"synthetic pairs (mean {report['mean_pair_tokens']:.0f} tokens a pair: prompt twice, both answers); LoRA "
        f"r{work['lora_rank']} alpha {work['lora_alpha']:g} on every linear layer; {work['loss']} loss, beta "
        f"{work['beta']}; lr {work['lr']:g}, cosine, {work['warmup_steps']} warm-up steps; {work['steps']} steps, "
        f"timed after step {work['warmup']}. TRL 1.16 as documented: {work['batch_pairs']} pairs a batch, "
        f"{_settings_text(trl)}. TuneDeck: `tunedeck train --method dpo`, packed rows of "
        f"{report['tokens_per_batch']:,} tokens, every switch automatic but the checkpointing a row names. Tokens: "
        "real tokens (no padding), counted the same way on both sides. Each row a fresh process. x TRL: against the "
        "`trl` row (TRL's defaults).",
        "",
        *like_for_like(report),
        "| side | checkpointing | tokens/s | x TRL | ms/step | tokens/step | peak reserved GiB | peak allocated GiB "
        "| NVML GiB | step-1 loss | mean loss, timed steps | switches on |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        ratio = report["ratios"].get(name)
        side = settings.get(name, {})
        lines.append(
            f"| {name} | {checkpointing_text(side)} | {number(r['tokens_per_s'])} | "
            f"{f'{ratio:.2f}' if ratio else '–'} | {r['ms_per_step'] or '–'} | {number(r.get('tokens_per_step'))} | "
            f"{r['peak_reserved_gib'] or '–'} | {r['peak_allocated_gib'] or '–'} | {r['driver_gib'] or '–'} | "
            f"{_loss(r.get('first_loss'))} | {_loss(r.get('mean_timed_loss'))} | "
            f"{', '.join(side.get('switches_on', [])) or '–'} |"
        )
    lines += ["", *[f"* {note}" for note in report["notes"]]]
    return "\n".join(lines) + "\n"


def like_for_like(report: dict[str, Any]) -> list[str]:
    """The headline: TuneDeck against TRL with the same choice of recompute on both sides (both with it, both without),
    for each pair of sides the record measured; empty where it measured no such pair."""
    rows, settings = report["sides"], report["settings"]
    lines = []
    for recompute, words in ((True, "with recompute on both sides"), (False, "without recompute on both sides")):
        trl = [n for n in rows if n.startswith("trl") and recomputes(settings.get(n, {})) is recompute]
        ours = [n for n in rows if n.startswith("tunedeck") and recomputes(settings.get(n, {})) is recompute]
        for theirs, mine in zip(trl, ours, strict=False):
            a, b = rows[theirs]["tokens_per_s"], rows[mine]["tokens_per_s"]
            if a and b:
                lines.append(
                    f"* **{words}: {b / a:.2f}x** TRL ({number(b)} against {number(a)} tokens/s; `{mine}` against "
                    f"`{theirs}`)"
                )
    if lines and len(lines) < 2:
        lines.append("* no pair with recompute on both sides was measured (a side with resident layers skips it)")
    return ["Like for like:", "", *lines, ""] if lines else []


def _settings_text(settings: dict[str, Any]) -> str:
    keys = ("gradient_checkpointing", "gradient_checkpointing_kwargs", "optim", "attn_implementation", "reference")
    return ", ".join(f"{key} {settings.get(key)}" for key in keys)


def _loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "–"


def notes(sides: dict[str, dict[str, Any]]) -> list[str]:
    """What a reader checks first: every side finished, their first losses agree, the timed steps were like for
    like."""
    out = [f"{name}: {side['outcome']}" for name, side in sides.items() if side["outcome"] != "RunFinished"]
    firsts = {name: side["figures"]["first_loss"] for name, side in sides.items() if "first_loss" in side["figures"]}
    if firsts:
        gap = max(firsts.values()) - min(firsts.values())
        listed = ", ".join(f"{value:.5f} ({name})" for name, value in firsts.items())
        out.append(f"step-1 losses {listed}: at most {gap:.1e} apart; ln 2 = {LN2:.5f} (a new adapter's B is zero, "
                   "so the policy is the reference)")  # fmt: skip
    for name, side in sides.items():
        if side["figures"].get("timed_steps_after_first_pass"):
            cached = side["figures"]["timed_steps_after_first_pass"]
            out.append(f"{name}: {cached} timed steps reused kept reference log-probabilities (more pairs avoid it)")
    return out


# --- the parent ---------------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, work: Workload) -> tuple[Path, Path, int, float]:
    """The model folder and pairs (made once in ``--work``) and TuneDeck's token budget for ``batch_pairs``."""
    args.work.mkdir(parents=True, exist_ok=True)
    folder = args.work / (work.shape + ("-tiny" if work.tiny else ""))
    if not (folder / "config.json").exists():
        build_model_folder(work.shape, folder, tiny=work.tiny)
        _release_gpu_memory()
    data = args.work / f"pairs_{work.pairs}.jsonl"
    write_pairs(data, work)
    mean = mean_pair_tokens(folder, data)
    return folder, data, math.ceil(work.batch_pairs * mean), mean


def _release_gpu_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_side(name: str, args: argparse.Namespace, work: Workload, prepared: tuple[Path, Path, int, float]) -> Any:
    import torch

    folder, data, tokens_per_batch, _ = prepared
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if name.startswith("trl"):
        return run_trl("engine.bench.dpo", args.work, work, folder, data, name, SIDES[name])
    command = tunedeck_command(folder, data, args.work / "runs", work, tokens_per_batch, SIDES[name])
    return run_tunedeck(command, logs / f"{name}.log", torch.cuda.is_available())


def parent_main(args: argparse.Namespace) -> int:
    work = workload(args)
    names = chosen_sides(args.sides, SIDES, "--dpo")
    prepared = prepare(args, work)
    sides = measure_sides(
        names, lambda name: run_side(name, args, work, prepared), lambda side: summarize(side, work.warmup)
    )
    report = {
        "environment": environment(),
        "workload": dataclasses.asdict(work),
        "mean_pair_tokens": prepared[3],
        "tokens_per_batch": prepared[2],
        **side_records(sides),
        "notes": notes(sides),
        "steps": {name: side["steps"] for name, side in sides.items()},
    }
    write_report(report, args.out, markdown(report))
    return finished(sides)


def workload(args: argparse.Namespace) -> Workload:
    changes = {key: getattr(args, key) for key in ("shape", "pairs", "batch_pairs", "steps", "warmup", "beta", "loss")
               if getattr(args, key) is not None}  # fmt: skip
    return Workload.tiny_cpu(**changes) if args.tiny else Workload(**changes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tunedeck bench --dpo", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", help="model shape (default qwen3-0.6b; llama-3.2-1b works too)")
    parser.add_argument("--tiny", action="store_true", help="two narrow layers, short pairs, 3 steps (runs on a CPU)")
    parser.add_argument("--pairs", type=int, help="pairs in the file (default 640)")
    parser.add_argument("--batch-pairs", type=int, help="pairs a step (default 8)")
    parser.add_argument("--steps", type=int, help="steps each side runs (default 50)")
    parser.add_argument("--warmup", type=int, help="steps left out of the timing (default 10)")
    parser.add_argument("--beta", type=float, help="DPO beta (default 0.1)")
    parser.add_argument("--loss", choices=("sigmoid", "ipo", "hinge"), help="DPO loss (default sigmoid)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--work", type=Path, default=Path("artifacts/dpo"), help="model folder, pairs, runs, logs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/dpo_h200.json"))
    add_child_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side == "trl":
        return trl_child(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
