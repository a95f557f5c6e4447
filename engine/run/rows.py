"""A run's row length and tokens per batch, settled before its data is packed (engine.hardware.row_lengths
decides), and on a CPU the threads it trains with (engine.hardware.cpu_threads).

Automatic values (0 in the config) are resolved once, at the start of a fresh run, and written into the run's
``config.json``: a resumed run packs the same rows whatever machine it continues on. On a GPU they are the
defaults; on a CPU they follow the model (its FLOPs per token) and the data (its longest example), so this module
reads the model's config (not its weights) and tokenizes the examples once to find the longest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from engine.config import DataConfig, ModelConfig, RunConfig
from engine.data.files import load_examples
from engine.data.packing import TokenizedPair
from engine.data.tokenize import ensure_chat_template, tokenize_examples
from engine.events import Event, Notice
from engine.hardware.cpu_threads import busy_cores, cpu_threads
from engine.hardware.row_lengths import RowLengths, choose_row_lengths
from engine.hardware.shapes import ModelShape
from engine.method_facts import facts_for
from engine.run import checkpoint as ckpt
from engine.run.folder import CONFIG_FILE

CPU_QLORA_NOTE = (
    "QLoRA on a CPU: bitsandbytes keeps the frozen weights in 4 bits and dequantizes each one on every use (no fast "
    "CPU kernel): it saves host memory for the weights, but each token takes about 2.5 times as long as with LoRA, "
    "and the rows are sized for that; leave out --qlora unless memory is short"
)


def resolve_rows(
    config: RunConfig,
    tokenizer: Any,
    device: torch.device,
    run_dir: Path | None,
    longest_document: Callable[[RunConfig, Any], int] | None = None,
) -> Generator[Event, None, RunConfig]:
    """The config with both values set, written to ``run_dir``'s config.json when given (by the process that owns
    the folder); on a CPU, a Notice says what was chosen and why."""
    data = config.data
    on_gpu = device.type == "cuda"
    if not on_gpu:
        lowered = use_free_cores()
        if lowered is not None:
            yield Notice(lowered)
        if config.model.qlora:
            yield Notice(CPU_QLORA_NOTE)
    if data.max_seq_len and data.tokens_per_batch:
        return config
    rows = choose_row_lengths(
        on_gpu=on_gpu,
        max_seq_len=data.max_seq_len,
        tokens_per_batch=data.tokens_per_batch,
        longest_document=None if on_gpu else (longest_document or _longest_example)(config, tokenizer),
        shape=None if on_gpu else model_shape(config.model),
        cpu_cores=torch.get_num_threads(),
        qlora=config.model.qlora,
        documents_per_item=facts_for(config.training.method).documents_per_item,  # a pair's answers share a row
    )
    if not on_gpu:
        for line in rows.lines():
            yield Notice(line)
    resolved = with_rows(config, rows)
    if run_dir is not None:
        ckpt.write_text_atomic(run_dir / CONFIG_FILE, json.dumps(resolved.to_dict(), indent=2) + "\n")
    return resolved


def _longest_example(config: RunConfig, tokenizer: Any) -> int:
    return longest_example(config.data, tokenizer)


def use_free_cores() -> str | None:
    """Train with the cores other programs leave free (engine.hardware.cpu_threads); why, where fewer. A thread
    count the user set (OMP_NUM_THREADS) is kept."""
    if "OMP_NUM_THREADS" in os.environ or (busy := busy_cores()) is None:
        return None
    threads, why = cpu_threads(torch.get_num_threads(), os.cpu_count() or 1, busy)
    torch.set_num_threads(threads)
    return why


def with_rows(config: RunConfig, rows: RowLengths) -> RunConfig:
    data = dataclasses.replace(config.data, max_seq_len=rows.max_seq_len, tokens_per_batch=rows.tokens_per_batch)
    return dataclasses.replace(config, data=data)


def longest_example(data: DataConfig, tokenizer: Any) -> int:
    """The most tokens one training or held-out document has, uncut (0 when the data is empty); a preference pair
    is two documents, the prompt with each answer."""
    ensure_chat_template(tokenizer)
    examples, _ = load_examples(data.path, data.format)
    if data.eval_path:
        held_out, _ = load_examples(data.eval_path, data.format)
        examples = [*examples, *held_out]
    tokenized, _ = tokenize_examples(
        tokenizer, examples, max_seq_len=sys.maxsize, train_on_all=data.train_on_all_tokens
    )
    documents = [d for ex in tokenized for d in (ex.documents() if isinstance(ex, TokenizedPair) else (ex,))]
    return max((len(document) for document in documents), default=0)


def model_shape(model: ModelConfig) -> ModelShape | None:
    """The model's shape from its config.json (no weights are read); None where it cannot be read as one."""
    from transformers import AutoConfig

    from engine.errors import TuneDeckError
    from engine.model.load import hub_offline, resolve_model

    try:
        source = resolve_model(model.name)
        config = AutoConfig.from_pretrained(
            source.location,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code is True,
            local_files_only=hub_offline(),
        )
        return ModelShape.from_config_dict(config.to_dict(), Path(model.name).name or model.name)
    except (TuneDeckError, OSError, ValueError):
        return None  # the model load says what is wrong with it; rows then take the GPU's defaults
