"""Builders for tests: tiny tokenizers, models and dataset files, made in milliseconds; benchmark scripts as modules."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

CORPUS = [
    "hello there, how are you today?",
    "the quick brown fox jumps over the lazy dog",
    "convert 12 march 2021 to 2021-03-12",
    "user assistant system: answer briefly.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-_'\"()[]{}<>/|\n",
]


def build_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer with ChatML special tokens, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.save_pretrained(folder)


def build_model(folder: Path, vocab_size: int, model_type: str = "llama", **overrides: object) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (registered by name, so its dataclasses resolve)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resident_room(monkeypatch: Any, layers: int = 1, from_start: bool = False) -> None:
    """Runs on this CPU decide resident layers as on a GPU with room for ``layers`` of them: the device facts carry
    a reachable memory figure, and the planner fits ``layers``. ``from_start``: sized before the first batch (a GPU
    sizes them when it arrives)."""
    import dataclasses

    from engine.speed import SpeedController, resident_layers
    from engine.speed import decide as deciding

    real = SpeedController.read_device_facts
    monkeypatch.setattr(
        SpeedController, "read_device_facts", lambda self: dataclasses.replace(real(self), reachable_bytes=2**30)
    )
    monkeypatch.setattr(resident_layers, "planned_layers_for", lambda *args: layers)
    if from_start:
        blocker = deciding._resident_blocker
        monkeypatch.setattr(
            deciding,
            "_resident_blocker",
            lambda device, run, plan: blocker(device, dataclasses.replace(run, longest_tokens=1), plan),
        )
