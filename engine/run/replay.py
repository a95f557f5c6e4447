"""Keeping knowledge: the base model's own answers to general prompts, mixed into a small set's training rows.

A few dozen examples of one task, trained for several passes, pull every answer the model gives toward that task,
and a small model loses facts it knew (measured on SmolLM2-135M-Instruct: the right fact in 57% of answers before,
13% after ten passes). Mixing in the base model's own answers to general requests (self-distillation replay; SDFT,
2024, trains on the base's own rephrasing for the same reason) gives the update something to keep: on those rows
the best the adapter can do is change nothing. The prompts ship in ``resources/replay`` and are not the knowledge
check's questions. The answers are generated once, greedily, with the adapter off, before the first step, and kept
in the run folder (``replay.jsonl``) so that a resumed run packs the same rows. Answers that do not end within
:data:`MAX_NEW_TOKENS` are left out (training on a cut answer would teach cutting answers).
"""

from __future__ import annotations

import json
import random
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.data.files import Conversation, Message
from engine.events import Event, Notice
from engine.run import checkpoint as ckpt
from engine.run.short_answers import answer_text, greedy_continuations, pad_token, stop_token_ids
from engine.speed.stand_in import adapters_off

REPLAY_FILE = "replay.jsonl"
MAX_NEW_TOKENS = 64
BATCH_SIZE = 16


def replay_prompts() -> list[str]:
    """The shipped general prompts, in file order."""
    import resources

    path = Path(resources.__file__).parent / "replay" / "prompts.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def chosen_prompts(count: int, seed: int) -> list[str]:
    """``count`` prompts (all of them at most), in an order fixed by the run's seed."""
    prompts = replay_prompts()
    random.Random(seed).shuffle(prompts)
    return prompts[: min(count, len(prompts))]


def as_examples(rows: Sequence[dict[str, str]]) -> list[Conversation]:
    return [
        Conversation((Message("user", row["prompt"]), Message("assistant", row["answer"])))
        for row in rows
        if row.get("answer")
    ]


def read_replay(run_dir: Path) -> list[dict[str, str]] | None:
    path = run_dir / REPLAY_FILE
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_replay(run_dir: Path, rows: Sequence[dict[str, str]]) -> None:
    ckpt.write_text_atomic(run_dir / REPLAY_FILE, "".join(json.dumps(row) + "\n" for row in rows))


@torch.no_grad()
def base_answers(model: Any, tokenizer: Any, prompts: Sequence[str], device: torch.device) -> list[dict[str, str]]:
    """Each prompt with the base model's greedy answer (adapter off); answers that did not end are left out."""
    stops = stop_token_ids(tokenizer, model)
    pad = pad_token(tokenizer, stops)
    rows: list[dict[str, str]] = []
    was_training = model.training
    model.eval()
    try:
        with adapters_off(model):
            for start in range(0, len(prompts), BATCH_SIZE):
                batch = list(prompts[start : start + BATCH_SIZE])
                encoded = [_prompt_ids(tokenizer, prompt) for prompt in batch]
                made = greedy_continuations(model, encoded, device, pad, stops, MAX_NEW_TOKENS)
                rows += _finished(tokenizer, batch, made, stops)
    finally:
        model.train(was_training)
    return rows


def _prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _finished(
    tokenizer: Any, prompts: Sequence[str], made: Sequence[Sequence[int]], stops: Sequence[int]
) -> list[dict[str, str]]:
    """The prompts whose answer ended within the limit, with the answer's text."""
    stop_set = set(stops)
    rows = []
    for prompt, new in zip(prompts, made, strict=True):
        if not any(token in stop_set for token in new):
            continue  # cut off at the token limit
        answer = answer_text(tokenizer, new, stops)
        if answer:
            rows.append({"prompt": prompt, "answer": answer})
    return rows


def replay_rows(
    model: Any, tokenizer: Any, device: torch.device, count: int, seed: int, run_dir: Path, write: bool
) -> Generator[Event, None, list[dict[str, str]]]:
    """The run's replay rows: those kept in its folder, or ``count`` new ones from the base model (written to the
    folder when ``write``)."""
    kept = read_replay(run_dir)
    if kept is not None:
        return kept
    prompts = chosen_prompts(round(count * 1.25) + 1, seed)  # some answers run past the limit and are left out
    yield Notice(f"keep knowledge: the base model answers {len(prompts)} general prompts to mix into the training rows")
    rows = base_answers(model, tokenizer, prompts, device)
    if write:
        write_replay(run_dir, rows)
    return rows
