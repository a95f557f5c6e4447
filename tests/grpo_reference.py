"""Running the same GRPO job through TuneDeck and through TRL's GRPOTrainer, step by step, for the comparison test.

Both start from one saved LoRA adapter, take the same prompts in every step, and are handed the
same answers: each sampling call is replaced by one that returns, for a prompt's k-th answer in the n-th sampling,
tokens drawn from a generator seeded with (prompt, k, n). The rewards are two small functions of the answer's
text, given to TuneDeck as reward objects and to TRL as reward functions with the same weights.

The prompts all have one token length: TuneDeck gives a left-padded prompt its true positions, TRL's update pass
counts the padding, so prompts of several lengths would differ by design, not by error.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig, SpeedConfig
from engine.events import RunFailed, StepMetrics
from engine.train import run

STEPS = 10
SEED = 42
GROUP = 4
MAX_NEW = 8
EOS = 2
"""The tiny tokenizer's end of turn (<|im_end|>), which its model's answers end with when they end."""
WORDS = "the quick brown fox jumps over lazy dog hello there how are you today".split()  # noqa: SIM905


def equal_length_prompts(tokenizer: Any, count: int = 2) -> list[str]:
    """``count`` text prompts with the same number of tokens."""
    by_length: dict[int, list[str]] = {}
    for i in range(200):
        text = " ".join(WORDS[(i + k * (1 + i // len(WORDS))) % len(WORDS)] for k in range(3)) + ":"
        by_length.setdefault(len(tokenizer(text)["input_ids"]), []).append(text)
    found = next(texts for texts in by_length.values() if len(set(texts)) >= count)
    return sorted(set(found))[:count]


def injected_answer(prompt: Sequence[int], k: int, sampling: int, vocab: int) -> list[int]:
    """The k-th answer to ``prompt`` in the ``sampling``-th sampling call: 1 to MAX_NEW tokens, ending with EOS
    unless cut at MAX_NEW."""
    rng = random.Random(hash((tuple(prompt), k, sampling, SEED)))
    length = rng.randint(1, MAX_NEW)
    tokens = [rng.randrange(3, vocab) for _ in range(length)]
    if length < MAX_NEW or rng.random() < 0.5:
        tokens[-1] = EOS
    return tokens


class Answers:
    """The injected sampler: counts sampling calls, hands out :func:`injected_answer`s."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.calls = 0

    def for_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """One answer per entry of ``prompts`` (a prompt's group repeats it); the k-th repeat gets answer k."""
        seen: dict[tuple[int, ...], int] = {}
        answers = []
        for prompt in prompts:
            k = seen.get(tuple(prompt), 0)
            seen[tuple(prompt)] = k + 1
            answers.append(injected_answer(prompt, k, self.calls, self.vocab))
        self.calls += 1
        return answers


def text_length(text: str) -> float:
    return len(text) / 10


def has_e(text: str) -> float:
    return 1.0 if "e" in text else 0.0


REWARD_WEIGHTS = (1.0, 0.5)


@dataclasses.dataclass
class ScoredBy:
    """A reward as TuneDeck builds them (engine.rewards.Reward)."""

    name: str
    weight: float
    score: Any

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        return float(self.score(completion))


def engine_rewards() -> list[ScoredBy]:
    return [ScoredBy("length", REWARD_WEIGHTS[0], text_length), ScoredBy("has_e", REWARD_WEIGHTS[1], has_e)]


def trl_rewards() -> list[Any]:
    def length(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [text_length(c) for c in completions]

    def e_present(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [has_e(c) for c in completions]

    return [length, e_present]


def engine_config(model_dir: Path, data: Path, adapter: Path, output: Path, prompts: int, **training: Any) -> RunConfig:
    """A GRPO run of ``STEPS`` steps over every prompt each step (``grad_accum`` prompts a step)."""
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir), "adapter": str(adapter), "dtype": "float32"},
            "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": 256, "eval_fraction": 0.0},
            "training": {
                "method": "grpo",
                "max_steps": STEPS,
                "grad_accum": prompts,
                "learning_rate": 2e-2,
                "warmup_steps": 0,
                "schedule": "constant",
                "eval_every": 0,
                "save_every": 0,
                "seed": SEED,
                "optimizer": "foreach",
                "device": "cpu",
                "group_size": GROUP,
                "max_new_tokens": MAX_NEW,
                "rewards": [{"kind": "length", "weight": 1.0, "settings": {"min": 1, "max": 8}}],
                **training,
            },
            "speed": dataclasses.asdict(SpeedConfig.stock()),
            "output": {"dir": str(output)},
        }
    )


def engine_steps(config: RunConfig) -> list[StepMetrics]:
    steps = []
    for event in run(config):
        assert not isinstance(event, RunFailed), event
        if isinstance(event, StepMetrics):
            steps.append(event)
    return steps


def trl_steps(
    model_dir: Path, data: Path, adapter: Path, output: Path, prompts: int, answers: Answers, **grpo: Any
) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    """TRL's logged metrics of each step and the advantages of each sampling."""
    from datasets import load_dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    advantages: list[torch.Tensor] = []

    class Injected(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> tuple[Any, None]:
            return answers.for_prompts([list(p) for p in prompt_ids]), None

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            advantages.append(out["advantages"].detach().clone())
            return out

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    args = GRPOConfig(
        output_dir=str(output),
        max_steps=STEPS,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=prompts * GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GROUP,
        max_completion_length=MAX_NEW,
        reward_weights=list(REWARD_WEIGHTS),
        seed=SEED,
        dataloader_num_workers=0,
        **grpo,
    )
    dataset = load_dataset("json", data_files=str(data), split="train")
    trainer = Injected(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, reward_funcs=trl_rewards()
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
    return logged, advantages
