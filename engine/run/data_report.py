"""What a dataset holds before a run with a given model: format, counts, bad rows, token lengths, packing, a preview.

The same reading, tokenizing and packing as training (engine.data.files, engine.data.tokenize, engine.data.packing),
so the preview's highlighted tokens are the ones the loss is computed on. Bad rows are collected with their row
numbers (engine.data.files.iter_row_problems) instead of stopping at the first. The model's tokenizer is read from
this computer unless the user asked for the hub (engine.model.hub.tokenizer_on_disk). The Dataset page runs
:func:`analyze_dataset` in a background job and only shows the report.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import DataConfig
from engine.data.files import detect_format, iter_row_problems, normalize_rows, read_rows
from engine.errors import ModelLoadError, TuneDeckError
from engine.hardware.row_lengths import GPU_TOKENS_PER_BATCH
from engine.model.hub import tokenizer_on_disk

if TYPE_CHECKING:
    from engine.data.packing import TokenizedExample

NO_TOKENIZER = "cannot read the dataset without the tokenizer of"
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
    image_tokens: int = 0
    """Image datasets (engine.run.vision_data_report): the image tokens among ``total_tokens``."""
    images: int = 0
    thumbnails: list[list[str]] = field(default_factory=list)
    """Per previewed example: its pictures' files."""


def analyze_dataset(
    path: str, model_name: str, data: DataConfig | None = None, *, use_hub: bool = False
) -> DatasetReport:
    """Read, check, tokenize and pack ``path`` as a run with ``model_name``'s tokenizer would; ``use_hub``: the
    user asked to fetch a tokenizer that is not on this computer. The rows are read first, so a broken file is
    reported as such before any tokenizer is looked for. torch is imported here, not with the module, so the
    window can import it."""
    from engine.data.packing import pack_examples, packing_efficiency
    from engine.data.tokenize import ensure_chat_template, tokenize_examples

    data = data or DataConfig(path=path)
    family = _vision_family(model_name)
    if family is not None:  # a vision-language model: pictures and text
        return _image_report(path, model_name, family, data)
    rows = read_rows(path)
    fmt = detect_format(rows, path) if data.format == "auto" else data.format
    problems = list(iter_row_problems(rows, fmt))
    bad = {row for row, _, _ in problems}
    good = [row for number, row in enumerate(rows, start=1) if number not in bad]
    examples = normalize_rows(good[:MAX_TOKENIZED], fmt, path)
    try:
        loaded = tokenizer_on_disk(model_name, use_hub)
    except TuneDeckError as err:  # the model's fault, not the dataset's: say so
        raise ModelLoadError(f"{NO_TOKENIZER} {model_name}: {err.message}", hint=err.hint) from err
    ensure_chat_template(loaded)
    # automatic (0) lengths: no example cut, and a GPU's rows (a CPU run picks shorter rows when it starts)
    longest = data.max_seq_len or sys.maxsize
    tokenized, _ = tokenize_examples(
        loaded, examples, max_seq_len=longest, overlong=data.overlong, train_on_all=data.train_on_all_tokens
    )
    lengths = [len(ex) for ex in tokenized]
    tokens_per_batch = max(data.tokens_per_batch or GPU_TOKENS_PER_BATCH, max(lengths, default=0))
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
        preview=[token_pieces(loaded, ex) for ex in tokenized[:PREVIEW_EXAMPLES]],
        sampled=len(good) > MAX_TOKENIZED,
    )


def _image_report(path: str, model_name: str, family: Any, data: DataConfig) -> DatasetReport:
    """An image dataset's report (engine.run.vision_data_report): rows padded, not packed; image tokens counted."""
    from engine.run.vision_data_report import image_data_figures

    found = image_data_figures(path, model_name, family, data.tokens_per_batch, MAX_TOKENIZED, PREVIEW_EXAMPLES)
    lengths = [len(item) for item in found.encoded]
    return DatasetReport(
        path=path,
        data_format=found.data_format,
        rows=found.rows,
        good_rows=found.good_rows,
        problems=found.problems,
        lengths=lengths,
        trained_tokens=sum(item.trained_tokens for item in found.encoded),
        total_tokens=sum(lengths),
        packed_rows=found.padded_rows,
        packing_efficiency=found.padding_efficiency,
        tokens_per_batch=found.tokens_per_batch,
        preview=found.preview,
        sampled=found.sampled,
        image_tokens=sum(item.image_tokens for item in found.encoded),
        images=found.images,
        thumbnails=found.thumbnails,
    )


def _vision_family(model_name: str) -> Any:
    """The vision family of a model on this computer (nothing is read from the network), None for a text model."""
    from engine.config import ModelConfig
    from engine.vision.model import vision_family

    return vision_family(ModelConfig(name=model_name), on_disk=True)


def token_pieces(tokenizer: Any, example: TokenizedExample) -> list[tuple[str, bool]]:
    """The example's tokens as text, each marked when the model is trained to predict it."""
    from engine.data.packing import IGNORE_INDEX

    pieces: list[tuple[str, bool]] = []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        text = str(tokenizer.decode([token]))
        trained = label != IGNORE_INDEX
        if pieces and pieces[-1][1] == trained:
            pieces[-1] = (pieces[-1][0] + text, trained)
        else:
            pieces.append((text, trained))
    return pieces
