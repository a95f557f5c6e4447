"""From a data config to packed training and evaluation rows.

Examples are read and normalised (engine.data.files), tokenized with loss masks (engine.data.tokenize), split into
train and held-out eval sets with the run's seed, and packed into rows with best-fit decreasing
(engine.data.packing). Rows are fixed for the whole run; each epoch visits them in a fresh seeded order, so the
position in the data is just a count of micro-batches, which makes resuming exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import DataConfig
from engine.data.files import Example, load_examples
from engine.data.packing import (
    PackedBatch,
    TokenizedExample,
    TokenizedPair,
    collate,
    pack_examples,
    packing_efficiency,
)
from engine.data.split import split_examples
from engine.data.tokenize import TokenizeReport, ensure_chat_template, tokenize_examples
from engine.errors import ConfigError, DataError
from engine.method_facts import facts_for


@dataclass
class PreparedData:
    """Packed rows ready to train on, plus what the user should be told about them."""

    train: list[TokenizedExample]
    eval: list[TokenizedExample]
    train_rows: list[list[int]]
    eval_rows: list[list[int]]
    data_format: str
    efficiency: float
    notices: list[str] = field(default_factory=list)

    def train_batch(self, row: int) -> PackedBatch:
        return collate([self.train[i] for i in self.train_rows[row]])

    def eval_batches(self) -> list[PackedBatch]:
        return [collate([self.eval[i] for i in row]) for row in self.eval_rows]


def _report_notices(report: TokenizeReport, config: DataConfig, added_template: bool) -> list[str]:
    notices = []
    if added_template:
        notices.append("the tokenizer has no chat template; using the built-in ChatML template")
    if report.truncated:
        notices.append(f"{report.truncated} example(s) longer than {config.max_seq_len} tokens were truncated")
    if report.dropped_overlong:
        notices.append(f"{report.dropped_overlong} example(s) longer than {config.max_seq_len} tokens were dropped")
    if report.dropped_untrained:
        notices.append(f"{report.dropped_untrained} example(s) had no tokens to learn from and were dropped")
    if report.template_fallbacks:
        notices.append(
            f"{report.template_fallbacks} conversation(s) could not be split into turns by the chat template; "
            "only their final answer is learned"
        )
    return notices


def _tokenize(tokenizer: Any, examples: Sequence[Any], config: DataConfig) -> tuple[list[TokenizedExample], Any]:
    return tokenize_examples(
        tokenizer,
        examples,
        max_seq_len=config.max_seq_len,
        overlong=config.overlong,
        train_on_all=config.train_on_all_tokens,
    )


def prepare_data(
    config: DataConfig, tokenizer: Any, seed: int, method: str = "sft", extra_train: Sequence[Example] = ()
) -> PreparedData:
    """Read, tokenize, split and pack; raises DataError when nothing usable is left or the data does not suit the
    training ``method`` (preference pairs for dpo, anything else for sft). A pair packs as one item. ``extra_train``
    examples (the base model's own answers, engine.run.replay) join the training rows after the split."""
    if not config.path:
        raise DataError("no dataset given", hint="pass --data PATH (a .jsonl/.json/.csv/.parquet file or a folder)")
    added_template = ensure_chat_template(tokenizer)
    examples, data_format = load_examples(config.path, config.format)
    check_method(data_format, method, config.path)
    if config.eval_path:
        train_raw = examples
        eval_raw, eval_format = load_examples(config.eval_path, config.format)
        check_method(eval_format, method, config.eval_path)
    else:
        train_raw, eval_raw = split_examples(examples, config.eval_fraction, seed)
    train, report = _tokenize(tokenizer, [*train_raw, *extra_train], config)
    evaluation, _ = _tokenize(tokenizer, eval_raw, config)
    if not train:
        raise DataError("no usable training examples are left after tokenization", path=config.path)
    _check_pairs_fit([*train, *evaluation], config.tokens_per_batch)
    train_rows = pack_examples(train, config.tokens_per_batch)
    lengths = [len(ex) for ex in train]
    return PreparedData(
        train=train,
        eval=evaluation,
        train_rows=train_rows,
        eval_rows=pack_examples(evaluation, config.tokens_per_batch) if evaluation else [],
        data_format=data_format,
        efficiency=packing_efficiency(lengths, train_rows, config.tokens_per_batch),
        notices=_report_notices(report, config, added_template),
    )


def _check_pairs_fit(examples: Sequence[TokenizedExample], budget: int) -> None:
    """A pair's two answers share a packed row, so the longest pair must fit one."""
    longest = max((len(ex) for ex in examples if isinstance(ex, TokenizedPair)), default=0)
    if longest > budget:
        raise ConfigError(
            f"data.tokens_per_batch ({budget}) must hold both answers of a pair: the longest pair has {longest} tokens",
            hint=f"--tokens-per-batch {longest} or more, or a smaller --max-seq-len (each answer with its prompt)",
        )


def check_method(data_format: str, method: str, path: str) -> None:
    """Preference pairs train with the method made for them (DPO) and only with it."""
    facts, pairs = facts_for(method), data_format == "preference"
    if facts.pairs and not pairs:
        raise DataError(
            f"{facts.title} needs preference pairs, but this is {data_format} data",
            path=path,
            hint="each row needs a prompt and a chosen and a rejected answer: prompt/chosen/rejected text, or "
            "chosen/rejected message lists that start with the same prompt turns",
        )
    if pairs and not facts.pairs:
        raise DataError(
            "this dataset holds preference pairs (chosen/rejected answers)",
            path=path,
            hint="train on it with --method dpo",
        )


def epoch_order(num_rows: int, epoch: int, seed: int) -> list[int]:
    """The row order of one epoch: a seeded permutation, the same on every run and after a resume."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


class RowSchedule:
    """Which packed row the n-th micro-batch of a run trains on."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows = num_rows
        self.seed = seed
        self._epoch = -1
        self._order: list[int] = []

    def row(self, micro_batch: int) -> int:
        epoch, offset = divmod(micro_batch, self.num_rows)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_rows, epoch, self.seed)
        return self._order[offset]

    def epoch(self, micro_batch: int) -> float:
        return micro_batch / self.num_rows
