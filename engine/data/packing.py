"""Packing tokenized examples into rows, and the per-row metadata every attention call needs.

Short examples are concatenated into rows of up to ``tokens_per_batch`` tokens with best-fit decreasing, so
almost no compute is spent on padding. No token may attend across documents, so each row carries the document
structure, computed once on the host by :func:`collate`: document lengths, ``cu_seqlens`` (int32 cumulative
lengths, the varlen-attention convention), ``max_seqlen`` (a Python int, so nothing has to ask the GPU for it),
``position_ids`` that restart at every document, and per-token document ids. Labels are masked at every
document start, because the first token of a document must not be predicted from the previous document.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedExample:
    """One document: its tokens and, per token, the label (the token itself, or IGNORE_INDEX when untrained)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


@dataclass(frozen=True)
class TokenizedPair(TokenizedExample):
    """A preference pair as one packed item: the chosen document (prompt + chosen answer) followed by the rejected
    one (prompt + rejected answer), ``chosen_length`` tokens and the rest. Packed and split as one item, so both
    answers always share a micro-batch; :func:`collate` gives each its own document (positions restart)."""

    chosen_length: int = 0

    def documents(self) -> tuple[TokenizedExample, TokenizedExample]:
        cut = self.chosen_length
        return (
            TokenizedExample(self.input_ids[:cut], self.labels[:cut]),
            TokenizedExample(self.input_ids[cut:], self.labels[cut:]),
        )

    @property
    def trained_tokens(self) -> int:
        return sum(document.trained_tokens for document in self.documents())

    @property
    def answer_tokens(self) -> tuple[int, int]:
        """Tokens of the chosen and of the rejected answer (IPO averages its log-probabilities over them)."""
        chosen, rejected = self.documents()
        return (
            sum(label != IGNORE_INDEX for label in chosen.labels),
            sum(label != IGNORE_INDEX for label in rejected.labels),
        )


@dataclass
class PackedBatch:
    """One packed row (batch size 1, the layout varlen attention wants) and its document metadata (host side)."""

    input_ids: torch.Tensor
    """(1, T) int64 token ids of all documents back to back."""
    labels: torch.Tensor
    """(1, T) int64; IGNORE_INDEX where no loss is taken (prompts, document starts)."""
    position_ids: torch.Tensor
    """(1, T) int64 positions restarting at 0 at each document."""
    document_ids: torch.Tensor
    """(1, T) int32 index of the document each token belongs to."""
    cu_seqlens: torch.Tensor
    """(D + 1,) int32 cumulative document lengths, starting at 0."""
    max_seqlen: int
    doc_lengths: tuple[int, ...]
    loss_positions: torch.Tensor | None = None
    """(K,) int64 flat positions t whose next label counts (``labels[t + 1] != IGNORE_INDEX``), found on the host
    so the fused loss never asks the GPU which positions train (that would be a host sync per micro-batch)."""
    host_input_ids: torch.Tensor | None = None
    """The token ids on the host, kept by :meth:`to`, so a lookup in host memory (the host-embedding switch) needs
    no copy back from the GPU (a host sync)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_documents(self) -> int:
        return len(self.doc_lengths)

    @property
    def trained_tokens(self) -> int:
        """Tokens that contribute to the loss (labels are shifted inside the model, so the first never does).

        Counted from the host-side positions when the packer listed them: on a batch already on the GPU,
        counting the labels would wait for the device."""
        if self.loss_positions is not None:
            return int(self.loss_positions.numel())
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with the tensors on ``device``; ``cu_seqlens`` and ``max_seqlen`` stay on the host."""
        move: dict[str, Any] = {"non_blocking": True} if torch.device(device).type == "cuda" else {}
        return PackedBatch(
            input_ids=self.input_ids.to(device, **move),
            labels=self.labels.to(device, **move),
            position_ids=self.position_ids.to(device, **move),
            document_ids=self.document_ids.to(device, **move),
            cu_seqlens=self.cu_seqlens,
            max_seqlen=self.max_seqlen,
            doc_lengths=self.doc_lengths,
            loss_positions=None if self.loss_positions is None else self.loss_positions.to(device, **move),
            host_input_ids=self.input_ids if self.input_ids.device.type == "cpu" else self.host_input_ids,
        )


def pack_best_fit(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group item indices into bins of at most ``budget`` tokens with best-fit decreasing.

    Each item (longest first) goes to the open bin whose remaining space is the smallest that still fits it,
    else to a new bin. Items longer than ``budget`` are an error: truncate or drop them first.
    Deterministic: ties keep the original order.
    """
    if budget < 1:
        raise ValueError(f"budget must be positive, got {budget}")
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(f"{len(too_long)} item(s) exceed the budget of {budget} tokens (first: index {too_long[0]})")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # (remaining space, bin index) sorted ascending: the first entry >= length is the best fit.
    space: list[tuple[int, int]] = []
    for item in order:
        need = lengths[item]
        pos = bisect.bisect_left(space, (need, -1))
        if pos == len(space):
            bins.append([item])
            bisect.insort(space, (budget - need, len(bins) - 1))
            continue
        remaining, bin_index = space.pop(pos)
        bins[bin_index].append(item)
        bisect.insort(space, (remaining - need, bin_index))
    return bins


def packing_efficiency(lengths: Sequence[int], bins: Sequence[Sequence[int]], budget: int) -> float:
    """Share of the rows' token budget filled with real tokens (1.0 is perfect packing)."""
    if not bins:
        return 0.0
    return sum(lengths) / (len(bins) * budget)


def collate(examples: Sequence[TokenizedExample]) -> PackedBatch:
    """Concatenate documents into one row and compute its metadata on the host (a pair is two documents, chosen
    then rejected)."""
    if not examples:
        raise ValueError("cannot collate an empty row")
    examples = [doc for ex in examples for doc in (ex.documents() if isinstance(ex, TokenizedPair) else (ex,))]
    lengths = tuple(len(ex) for ex in examples)
    if min(lengths) < 1:
        raise ValueError("cannot pack an empty document")
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    doc_ids: list[int] = []
    for doc, ex in enumerate(examples):
        input_ids.extend(ex.input_ids)
        labels.append(IGNORE_INDEX)  # a document's first token is never predicted from the previous one
        labels.extend(ex.labels[1:])
        positions.extend(range(len(ex)))
        doc_ids.extend([doc] * len(ex))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    trained = [t for t in range(len(labels) - 1) if labels[t + 1] != IGNORE_INDEX]
    return PackedBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        document_ids=torch.tensor([doc_ids], dtype=torch.int32),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lengths),
        doc_lengths=lengths,
        loss_positions=torch.tensor(trained, dtype=torch.long),
    )


def pack_examples(examples: Sequence[TokenizedExample], budget: int) -> list[list[int]]:
    """Best-fit-decreasing rows of example indices for ``examples`` under a token ``budget``."""
    return pack_best_fit([len(ex) for ex in examples], budget)
