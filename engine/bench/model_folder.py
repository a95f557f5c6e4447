"""A loadable model folder of a known shape with random weights, and a text dataset of long rows.

The GPU machine has no model hub, so the benchmarks that run the product itself (``tunedeck train``, the window's
run path) give it what a user would download: a folder with the shape's config, random bf16 safetensors shards
(norms 1, the rest N(0, 0.02)) with their index, and the demo model's tokenizer; and a JSONL file of text rows.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILES", "build_model_folder", "shape_config", "train_args", "write_rows"]

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
WORDS = ("alpha", "river", "stone", "light", "seven", "under", "green", "table", "music", "north", "cloud", "paper")


def shape_config(shape: str, tiny: bool = False) -> Any:
    """The shape's transformers config (the 4-bit bench's 7-8B shapes or the 16-bit bench's small dense ones), with
    the demo tokenizer's special tokens; ``tiny``: 2 narrow layers."""
    from transformers import AutoConfig

    from engine.bench.qlora import SHAPES, model_config
    from engine.bench.speed import DENSE_SHAPES

    if shape in SHAPES:
        config = model_config(shape)
    else:
        settings = dict(DENSE_SHAPES[shape])
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    config.eos_token_id, config.bos_token_id, config.pad_token_id = 2, None, 3
    config.dtype = "bfloat16"
    if tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size = 2, 256, 512, 1024
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:2]
    return config


def build_model_folder(shape: str, folder: Path, tiny: bool = False, shard_bytes: int = 4 * GIB) -> None:
    """A loadable model folder: the shape's config, random bf16 weights (norms 1, the rest N(0, 0.02)) in
    safetensors shards with their index, and the demo model's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = shape_config(shape, tiny)
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in AutoModelForCausalLM.from_config(config).state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, Any] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, size in shapes.items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # the embedding's own tensor once loaded, as in the real model's files
        if len(size) == 1:
            shard[name] = torch.ones(size, dtype=torch.bfloat16)
        else:
            shard[name] = (torch.randn(size, device=device, dtype=torch.bfloat16, generator=generator) * 0.02).cpu()
        if sum(t.numel() * 2 for t in shard.values()) > shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for file in TOKENIZER_FILES:
        shutil.copy(ROOT / "resources" / "demo" / "model" / file, folder / file)


def write_rows(path: Path, rows: int, words: int, seed: int = 0) -> None:
    """``rows`` text rows of ``words`` random words each (about 3.8 demo-tokenizer tokens a word)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(rows):
            text = " ".join(rng.choice(WORDS) + rng.choice("abcdefgh") for _ in range(words))
            out.write(json.dumps({"text": text}) + "\n")


def train_args(folder: Path, data: Path, tokens: int, steps: int, output: Path) -> list[str]:
    """``tunedeck train`` as a user would run QLoRA r32 on long rows, every speed switch automatic."""
    return [
        "train", "--model", str(folder), "--qlora", "--lora-rank", "32", "--data", str(data),
        "--data-format", "text", "--train-on-all-tokens", "--max-seq-len", str(tokens),
        "--tokens-per-batch", str(tokens), "--eval-fraction", "0", "--max-steps", str(steps),
        "--json", "--output", str(output),
    ]  # fmt: skip
