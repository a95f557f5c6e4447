"""A run's automatic settings, settled once at the start of a fresh run (engine.hardware.fit_to_data decides).

The facts are read here: the dataset's examples and tokens (read and tokenized once), the model's size from its
config (no weights), and whether it is instruction-tuned (its tokenizer has a chat template of its own). The
chosen values are written into the run's ``config.json``, as the row lengths are (engine.run.rows), so a resumed
run trains the same steps with the same settings whatever has changed since; a Notice says what was chosen and why.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from engine.config import RunConfig
from engine.data.files import load_examples
from engine.data.packing import TokenizedPair
from engine.data.tokenize import ensure_chat_template, tokenize_examples
from engine.events import Event, Notice
from engine.hardware.fit_to_data import FitFacts, apply_fit, fit_to_data
from engine.run import checkpoint as ckpt
from engine.run.folder import CONFIG_FILE
from engine.run.rows import model_shape


def has_automatic(config: RunConfig) -> bool:
    """Whether any setting that follows the data is left automatic."""
    training, lora = config.training, config.lora
    return (
        config.data.eval_fraction is None
        or (training.max_steps == 0 and training.epochs == 0)
        or training.learning_rate == 0
        or None
        in (
            training.eval_every,
            training.early_stop,
            training.warmup_steps,
            training.keep_knowledge,
            training.knowledge_penalty,
        )
        or lora.rank == 0
        or lora.alpha == 0
    )


def fit_run(
    config: RunConfig,
    tokenizer: Any,
    instruct: bool,
    run_dir: Path | None,
    measure: Callable[[RunConfig, Any], tuple[int, int]] | None = None,
) -> Generator[Event, None, RunConfig]:
    """``config`` with its automatic settings chosen, written to ``run_dir``'s config.json when given."""
    if not has_automatic(config):
        return config
    shape = model_shape(config.model)
    examples, tokens = (measure or dataset_size)(config, tokenizer)
    facts = FitFacts(
        examples=examples,
        tokens=tokens,
        separate_held_out=bool(config.data.eval_path),
        parameters=shape.total_params() if shape is not None else None,
        instruct=instruct,
        method=config.training.method,
        tokens_per_batch=config.data.tokens_per_batch,
        grad_accum=config.training.grad_accum,
        knowledge_share=config.training.knowledge_share,
    )
    resolved, lines = apply_fit(config, fit_to_data(facts))
    if lines:
        yield Notice("automatic settings for this data (a flag sets any of them):\n  " + "\n  ".join(lines))
    if run_dir is not None and run_dir.is_dir():
        ckpt.write_text_atomic(run_dir / CONFIG_FILE, json.dumps(resolved.to_dict(), indent=2) + "\n")
    return resolved


def dataset_size(config: RunConfig, tokenizer: Any) -> tuple[int, int]:
    """(examples, tokens) of the training file; a preference pair counts both its documents' tokens."""
    ensure_chat_template(tokenizer)
    examples, _ = load_examples(config.data.path, config.data.format)
    tokenized, _ = tokenize_examples(
        tokenizer, examples, max_seq_len=sys.maxsize, train_on_all=config.data.train_on_all_tokens
    )
    tokens = sum(sum(len(d) for d in ex.documents()) if isinstance(ex, TokenizedPair) else len(ex) for ex in tokenized)
    return len(tokenized), tokens
