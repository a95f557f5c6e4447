"""Running the same DPO job through TuneDeck and through TRL's DPOTrainer, step by step, for the comparison tests.

Both start from one saved LoRA adapter, fresh (B matrices zero, so the model as it starts is the base model) or
trained (B matrices non-zero), and measure against the model as it starts: TRL copies the starting adapter into a
frozen "ref" adapter, TuneDeck scores the start before its first step (or, from a fresh adapter, the base). They take
the same pairs in the same optimizer steps (TuneDeck's packed rows, handed to TRL as its batches) and update with
AdamW at a constant learning rate.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig, SpeedConfig
from engine.data.packing import TokenizedPair
from engine.data.prepare import RowSchedule, prepare_data
from engine.data.tokenize import CHATML_TEMPLATE
from engine.events import RunFailed, StepMetrics
from engine.model.load import load_tokenizer
from engine.train import run

STEPS = 10
SEED = 42
REWARD_KEYS = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "reward_accuracy": "rewards/accuracies",
}
"""TuneDeck's StepMetrics field -> TRL's logged metric."""

STARTING_B_STD = 0.05
"""A trained starting adapter's B entries: enough to move the answers' log-probabilities well off the base's."""

WORDS = "the quick brown fox jumps over lazy dog hello there how are you today convert march answer briefly".split()  # noqa: SIM905


def preference_rows(chat: bool, count: int = 16) -> list[dict[str, Any]]:
    """Pairs of varied lengths, as prompt/chosen/rejected text or as chosen/rejected message lists."""
    rows = []
    for i in range(count):
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 4))
        chosen = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + i % 5))
        rejected = " ".join(WORDS[(5 * i + 2 * k + 1) % len(WORDS)] for k in range(2 + i % 3))
        if chat:
            question = {"role": "user", "content": prompt}
            rows.append(
                {
                    "chosen": [question, {"role": "assistant", "content": chosen}],
                    "rejected": [question, {"role": "assistant", "content": rejected}],
                }
            )
        else:
            rows.append({"prompt": f"{prompt}: ", "chosen": chosen, "rejected": rejected})
    return rows


def save_starting_adapter(model_dir: Path, folder: Path, trained: bool = False) -> Path:
    """A LoRA adapter on every linear layer, saved in PEFT format: fresh (A random, B zero), or ``trained`` (B random
    too, so the model it makes is not the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    if trained:
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, STARTING_B_STD)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return folder


def engine_config(
    model_dir: Path, data: Path, adapter: Path, output: Path, speed: SpeedConfig, tokens: int, **training: Any
) -> RunConfig:
    """A DPO run of ``STEPS`` steps, one packed row of up to ``tokens`` tokens (several pairs) a step."""
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir), "adapter": str(adapter), "dtype": training.pop("dtype", "float32")},
            "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": tokens, "eval_fraction": 0.0},
            "training": {
                "method": "dpo",
                "max_steps": STEPS,
                "learning_rate": 2e-3,
                "warmup_steps": 0,
                "schedule": "constant",
                "eval_every": 0,
                "save_every": 0,
                "seed": SEED,
                "optimizer": "foreach",
                **training,
            },
            "speed": dataclasses.asdict(speed),
            "dpo": {"beta": 0.1, "loss": "sigmoid"},
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


def engine_batches(config: RunConfig) -> tuple[list[list[int]], list[TokenizedPair]]:
    """The pairs (dataset row numbers) of each of TuneDeck's steps, and its tokenized pairs."""
    tokenizer = load_tokenizer(config.model)
    prepared = prepare_data(config.data, tokenizer, config.training.seed, "dpo")
    pairs = [pair for pair in prepared.train if isinstance(pair, TokenizedPair)]
    schedule = RowSchedule(len(prepared.train_rows), config.training.seed)
    return [list(prepared.train_rows[schedule.row(step)]) for step in range(STEPS)], pairs


def trl_steps(
    model_dir: Path,
    data: Path,
    adapter: Path,
    output: Path,
    batches: list[list[int]],
    device: str = "cpu",
    **extra: Any,
) -> tuple[list[dict[str, float]], Any]:
    """TRL's logged metrics of each step (TuneDeck's batches in TuneDeck's order), and its tokenized dataset."""
    from datasets import load_dataset
    from peft import PeftModel
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class EngineBatches(DPOTrainer):
        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_dataset, batch_sampler=batches, collate_fn=self.data_collator)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = tokenizer.chat_template or CHATML_TEMPLATE  # TuneDeck's own when a model has none
    dtype = extra.pop("dtype", torch.float32)
    extra.setdefault("bf16", dtype == torch.bfloat16)  # TRL's default is bf16 autocast, even on a CPU
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    args = DPOConfig(
        output_dir=str(output),
        max_steps=STEPS,
        learning_rate=2e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        gradient_checkpointing=False,
        beta=0.1,
        loss_type=["sigmoid"],
        max_length=None,
        seed=SEED,
        dataloader_num_workers=0,
        **extra,
    )
    dataset = load_dataset("json", data_files=str(data), split="train")
    trainer = EngineBatches(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "rewards/chosen" in entry]
    return logged, trainer.train_dataset
