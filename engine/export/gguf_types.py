"""What a GGUF file really holds: its tensor types counted, the tensors that fell back, and a better choice.

llama.cpp's k-quants (q4_k_m and friends) store rows in blocks of 256 values. A tensor whose rows (columns, in
llama.cpp's words) are not a multiple of 256 cannot take a k-quant, and llama.cpp quietly gives it another type
(q4_K -> q5_0, q6_K -> q8_0, ...). On a model whose hidden size is 576 (SmolLM2-135M) that is 180 of its 272
tensors: a file called "q4_k_m" that is mostly q5_0. So an export reads its own file back and says what it holds,
and suggests a type with no fallback when more than a tenth of the quantized tensors fell back.

llama.cpp also prints one warning line per fallen-back tensor; :func:`fallback_line` turns those lines into one.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

K_BLOCK = 256  # values per k-quant block (llama.cpp's QK_K)
FALLBACK_SHARE = 0.1  # more than this share of the quantized tensors fell back: suggest another type
KEPT_TYPES = {"F32"}  # norms, biases, routers: kept in float32 on purpose, never a fallback
WARNING = re.compile(
    r"(?P<tensor>\S+)\s+- ncols\s+(?P<cols>\d+) not divisible by (?P<block>\d+) "
    r"\(required for type\s+(?P<wanted>\w+)\)\s*-> falling back to\s+(?P<got>\w+)"
)


@dataclass(frozen=True)
class TensorTypes:
    """The tensor types of one GGUF file against the quantization that was asked for."""

    requested: str  # "q4_k_m", "q8_0", ...
    counts: tuple[tuple[str, int], ...]  # ("Q5_0", 180), ... most common first
    quantized: int  # tensors with two or more dimensions: the ones a quantization applies to
    fallback: int  # of those, how many did not get the requested kind of type
    fallback_types: tuple[tuple[str, int], ...]  # the types they got instead, most common first
    columns: tuple[int, ...]  # row lengths of the fallen-back tensors that the block size does not divide
    block: int  # the requested type's block size

    @property
    def fell_back_much(self) -> bool:
        return self.quantized > 0 and self.fallback > FALLBACK_SHARE * self.quantized

    def types_text(self) -> str:
        return ", ".join(f"{count} {kind}" for kind, count in self.counts)

    def reason(self) -> str:
        if not self.fallback:
            return ""
        if not self.columns:
            return f"fallback: {self.fallback} of {self.quantized} tensors"
        cols = ", ".join(str(c) for c in self.columns)
        return f"fallback: {cols} columns are not a multiple of {self.block}"

    def summary(self) -> str:
        """e.g. "q4_k_m requested: 180 Q5_0, 61 F32, 30 Q4_K (fallback: 576 columns are not a multiple of 256)"."""
        reason = self.reason()
        return f"{self.requested} requested: {self.types_text()}" + (f" ({reason})" if reason else "")

    def suggestion(self) -> str | None:
        """The nearest type without fallback, when more than a tenth of the quantized tensors fell back."""
        if not self.fell_back_much:
            return None
        instead = self.fallback_types[0][0].lower() if self.fallback_types else "f16"
        block = _block_size(instead)
        if instead not in DIRECT_TYPES or any(c % block for c in self.columns):
            instead = "f16"
        also = "" if instead in ("q8_0", "f16") else " (or q8_0, larger and closer to the fine-tune)"
        share = f"{self.fallback} of {self.quantized}"
        return f"{share} quantized tensors fell back from {self.requested}: export {instead}{also} for one type"

    def file_label(self) -> str:
        """What the file name says: the requested type, and the fallback type where much fell back."""
        if not self.fell_back_much or not self.fallback_types:
            return self.requested
        most = "mostly" if 2 * self.fallback > self.quantized else "with"
        return f"{self.requested}-{most}-{self.fallback_types[0][0].lower()}"


DIRECT_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def _block_size(kind: str) -> int:
    import gguf

    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.upper()]][0])


def _expected(requested: str, kind: str) -> bool:
    """Whether a tensor of ``kind`` got what ``requested`` asks for (a k-quant file mixes several K types)."""
    if kind in KEPT_TYPES:
        return True
    if "_k" in requested:
        return kind.endswith("_K")
    return kind == requested.upper()


def requested_quant(reader: Any) -> str:
    """The quantization a GGUF file says it is (general.file_type), as TuneDeck names it."""
    import gguf

    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.contents())).name
    return "f32" if name == "ALL_F32" else name.removeprefix("MOSTLY_").lower()


def tensor_types(path: str | Path, requested: str | None = None) -> TensorTypes:
    """Count the tensor types in the GGUF file at ``path`` and find the tensors that fell back."""
    import gguf

    reader = gguf.GGUFReader(path)
    requested = requested or requested_quant(reader)
    counts: Counter[str] = Counter()
    fallback: Counter[str] = Counter()
    quantized = 0
    block = K_BLOCK if "_k" in requested else _block_size(requested) if requested in DIRECT_TYPES else 1
    columns: set[int] = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        counts[kind] += 1
        if len(tensor.shape) < 2 or requested == "f32":
            continue
        quantized += 1
        if not _expected(requested, kind):
            fallback[kind] += 1
            cols = int(tensor.shape[0])  # GGUF lists the row length first
            if cols % block:
                columns.add(cols)
    return TensorTypes(
        requested=requested,
        counts=tuple(counts.most_common()),
        quantized=quantized,
        fallback=sum(fallback.values()),
        fallback_types=tuple(fallback.most_common()),
        columns=tuple(sorted(columns)),
        block=block,
    )


def fallback_line(log: str) -> str | None:
    """llama.cpp's per-tensor fallback warnings in ``log`` as one line, or None when there are none."""
    found = [match.groupdict() for match in WARNING.finditer(" ".join(log.split()))]
    if not found:
        return None
    moves = Counter(f"{m['wanted']} -> {m['got']}" for m in found)
    cols = sorted({int(m["cols"]) for m in found})
    block = found[0]["block"]
    what = ", ".join(f"{move} ({count})" for move, count in moves.most_common())
    width = ", ".join(str(c) for c in cols)
    return f"llama.cpp fell back on {len(found)} tensors ({width} columns not divisible by {block}): {what}"
