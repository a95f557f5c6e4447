"""The tokenizer inside a GGUF file: vocabulary, merges, special token ids and the chat template.

Byte-level BPE tokenizers (GPT-2 style: Llama-3, Qwen, the demo model) become llama.cpp's ``gpt2`` tokenizer
model with a named pre-tokenizer; SentencePiece-style BPE tokenizers with byte fallback (Llama-2, Mistral,
Gemma) become its ``llama`` model, scored by merge rank so llama.cpp merges in the same order. Special token
ids, add-bos/eos flags and the chat template are read by the ``gguf`` package's SpecialVocab from the saved
tokenizer folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from engine.errors import TuneDeckError

O200K_START = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s"
GPT2_REGEX = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"


def _split_regexes(pre: dict[str, Any]) -> list[str]:
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    found = []
    for step in steps:
        if step.get("type") == "Split":
            found.append(step.get("pattern", {}).get("Regex", ""))
        elif step.get("type") == "Digits":
            found.append("\\p{N}" if step.get("individual_digits") else "\\p{N}+")
        elif step.get("type") == "ByteLevel" and step.get("use_regex", True):
            found.append(GPT2_REGEX)
    return found


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (how text is split before BPE)."""
    regexes = _split_regexes(tokenizer_json.get("pre_tokenizer") or {})
    if regexes == [GPT2_REGEX]:
        return "gpt-2"
    if regexes == ["\\p{N}", GPT2_REGEX]:
        return "starcoder"
    if len(regexes) == 1 and regexes[0].startswith(O200K_START) and "\\p{N}{1,3}" in regexes[0]:
        return "gpt-4o"  # o200k split: gpt-oss, GPT-4o-style tokenizers
    if len(regexes) == 1 and regexes[0].startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)"):
        return "llama-bpe" if "\\p{N}{1,3}" in regexes[0] else "qwen2"
    if len(regexes) == 1 and regexes[0].startswith("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"):
        return "qwen2"  # the case-spelled form of the same split some tokenizers save
    return "default"


def _token_types(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    import gguf

    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(added[index].content)
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _merge_ranks(model: dict[str, Any]) -> dict[str, int]:
    """Token text -> rank of the merge that makes it (earlier merges win)."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(left + right, rank)
    return ranks


def _sentencepiece_tokens(
    tokenizer: Any, model: dict[str, Any], vocab_size: int
) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style BPE (byte fallback): llama.cpp merges by score, so a token scores minus its merge rank."""
    import gguf

    tokens, types = _token_types(tokenizer, vocab_size)
    ranks = _merge_ranks(model)
    unknown = model.get("unk_token")
    scores = []
    for index, token in enumerate(tokens):
        scores.append(-float(ranks[token]) if token in ranks else (0.0 if len(token) == 1 else -1e9))
        if types[index] == gguf.TokenType.NORMAL and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            types[index] = int(gguf.TokenType.BYTE)
        elif token == unknown:
            types[index] = int(gguf.TokenType.UNKNOWN)
    return tokens, scores, types


def _is_byte_level(tokenizer_json: dict[str, Any]) -> bool:
    decoder = tokenizer_json.get("decoder") or {}
    return any(step.get("type") == "ByteLevel" for step in decoder.get("decoders", [decoder]))


def _adds_space_prefix(tokenizer_json: dict[str, Any]) -> bool:
    """Whether the tokenizer puts a "▁" before the text (a Prepend normalizer or a Metaspace that prepends)."""
    normalizer = tokenizer_json.get("normalizer") or {}
    steps = normalizer.get("normalizers", [normalizer])
    if any(step.get("type") == "Prepend" for step in steps):
        return True
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    return any(s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never" for s in steps)


def add_tokenizer(writer: Any, tokenizer: Any, folder: Path, vocab_size: int) -> None:
    """Write the tokenizer saved in ``folder`` (tokenizer.json etc.) into the GGUF metadata."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.exists():
        raise TuneDeckError("GGUF export needs a fast tokenizer (tokenizer.json); this model's tokenizer has none")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") == "BPE" and _is_byte_level(data):
        tokens, types = _token_types(tokenizer, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer_name(data))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        tokens, scores, types = _sentencepiece_tokens(tokenizer, model, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(_adds_space_prefix(data))
        special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=vocab_size)
    else:
        raise TuneDeckError(
            f"GGUF export does not support this {model.get('type')!r} tokenizer",
            hint="it supports byte-level BPE (GPT-2, Llama-3, Qwen style) and SentencePiece-style BPE with byte "
            "fallback (Llama-2, Mistral, Gemma style)",
        )
    special.add_to_gguf(writer, quiet=True)
