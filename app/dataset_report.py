"""What the dataset page shows, computed off the GUI thread: format, counts, token lengths, packing, a preview.

The preview is tokenized exactly as training will tokenize it (engine.data.tokenize), so the highlighted tokens are
the ones the loss is computed on. Bad rows are collected with their row numbers (engine.data.files.iter_row_problems)
instead of stopping at the first. Qt-free.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import DataConfig, ModelConfig
from engine.errors import ModelLoadError, TuneDeckError
from engine.hardware.row_lengths import GPU_TOKENS_PER_BATCH

TOKENIZER_LOCK = threading.Lock()
"""Two first imports of transformers' lazy AutoTokenizer in two threads fail ("cannot import name
'AutoTokenizer'"), e.g. the demo data loading for the demo model while the user opens a file: one at a time."""
NO_TOKENIZER = "cannot read the dataset without the tokenizer of"
FETCH_HINT = "fetch it from the Hugging Face hub with the Dataset page's button (a few MB), or choose another model"
MAX_TOKENIZED = 5000
"""Examples tokenized for the histogram and packing figures; larger datasets are sampled from the start."""
PREVIEW_EXAMPLES = 4


@dataclass(frozen=True)
class DatasetReport:
    path: str
    data_format: str
    rows: int
    good_rows: int
    problems: list[tuple[int, str, str]]
    """(row number, field, message) of every unusable row."""
    lengths: list[int]
    trained_tokens: int
    total_tokens: int
    packed_rows: int
    packing_efficiency: float
    tokens_per_batch: int
    preview: list[list[tuple[str, bool]]] = field(default_factory=list)
    """Per previewed example: (token text, trained?) pieces."""
    sampled: bool = False


def load_tokenizer_on_disk(model_name: str, use_hub: bool = False) -> Any:
    """``model_name``'s tokenizer from its folder or the Hugging Face cache; from the hub only when ``use_hub`` (the
    user asked). The app promises to send nothing unasked: a hub id is never looked up, not even for updates."""
    from engine.model.load import hub_offline, load_tokenizer, resolve_model

    if resolve_model(model_name).is_local or (use_hub and not hub_offline()):
        return load_tokenizer(ModelConfig(name=model_name))
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoTokenizer

    # A cache lookup on disk, then a load from that folder: huggingface_hub's own calls, local_files_only included,
    # send a request on their first use (its agent registry) unless the hub is switched off.
    cached = try_to_load_from_cache(model_name, "tokenizer.json")
    if not isinstance(cached, str):
        raise ModelLoadError("it is not on this computer", hint=FETCH_HINT)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(cached).parent))
    except Exception as err:  # a cache without the other tokenizer files
        raise ModelLoadError(f"it is not whole on this computer: {err}", hint=FETCH_HINT) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def analyze_dataset(
    path: str, model_name: str, data: DataConfig | None = None, *, use_hub: bool = False
) -> DatasetReport:
    """Read, check, tokenize and pack ``path`` as a run with ``model_name``'s tokenizer would; ``use_hub``: the
    user asked to fetch a tokenizer that is not on this computer."""
    from engine.data.files import detect_format, iter_row_problems, normalize_rows, read_rows
    from engine.data.packing import pack_examples, packing_efficiency
    from engine.data.tokenize import ensure_chat_template, tokenize_examples

    data = data or DataConfig(path=path)
    rows = read_rows(path)
    fmt = detect_format(rows, path) if data.format == "auto" else data.format
    problems = list(iter_row_problems(rows, fmt))
    bad = {row for row, _, _ in problems}
    good = [row for number, row in enumerate(rows, start=1) if number not in bad]
    examples = normalize_rows(good[:MAX_TOKENIZED], fmt, path)
    with TOKENIZER_LOCK:
        try:
            tokenizer = load_tokenizer_on_disk(model_name, use_hub)
        except TuneDeckError as err:  # the model's fault, not the dataset's: say so
            raise ModelLoadError(f"{NO_TOKENIZER} {model_name}: {err.message}", hint=err.hint) from err
    ensure_chat_template(tokenizer)
    # automatic (0) lengths: no example cut, and a GPU's rows (a CPU run picks shorter rows when it starts)
    longest = data.max_seq_len or sys.maxsize
    tokens_per_batch = data.tokens_per_batch or GPU_TOKENS_PER_BATCH
    tokenized, _ = tokenize_examples(
        tokenizer, examples, max_seq_len=longest, overlong=data.overlong, train_on_all=data.train_on_all_tokens
    )
    lengths = [len(ex) for ex in tokenized]
    tokens_per_batch = max(tokens_per_batch, max(lengths, default=0))
    packed = pack_examples(tokenized, tokens_per_batch) if tokenized else []
    return DatasetReport(
        path=path,
        data_format=fmt,
        rows=len(rows),
        good_rows=len(good),
        problems=problems,
        lengths=lengths,
        trained_tokens=sum(ex.trained_tokens for ex in tokenized),
        total_tokens=sum(lengths),
        packed_rows=len(packed),
        packing_efficiency=packing_efficiency(lengths, packed, tokens_per_batch),
        tokens_per_batch=tokens_per_batch,
        preview=[token_pieces(tokenizer, ex) for ex in tokenized[:PREVIEW_EXAMPLES]],
        sampled=len(good) > MAX_TOKENIZED,
    )


def token_pieces(tokenizer: Any, example: Any) -> list[tuple[str, bool]]:
    """The example's tokens as text, each marked when the model is trained to predict it."""
    from engine.data.packing import IGNORE_INDEX

    pieces: list[tuple[str, bool]] = []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        text = tokenizer.decode([token])
        trained = label != IGNORE_INDEX
        if pieces and pieces[-1][1] == trained:
            pieces[-1] = (pieces[-1][0] + text, trained)
        else:
            pieces.append((text, trained))
    return pieces
