"""Model shapes: the handful of numbers from a model's ``config.json`` that decide its training memory.

The planner never loads weights: hidden size, layer count, heads, vocabulary and (for MoE models) expert sizes
are enough to count parameters and activations. Common models ship here as small config dicts so that
``tunedeck plan --model llama-3.1-8b`` works offline; any local Hugging Face folder or ``config.json`` works too.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import DEMO_MODEL, demo_model_dir
from engine.errors import ConfigError

# Transcribed from the models' published config.json files (only the fields the planner reads).
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "qwen3-14b": {
        "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    },
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "mistral-7b": {
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
        "tie_word_embeddings": False,
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
        "tie_word_embeddings": False, "num_local_experts": 32, "num_experts_per_tok": 4,
    },
}  # fmt: skip

PRETTY_NAMES = {
    "qwen3-0.6b": "Qwen3-0.6B",
    "qwen3-1.7b": "Qwen3-1.7B",
    "qwen3-4b": "Qwen3-4B",
    "qwen3-8b": "Qwen3-8B",
    "qwen3-14b": "Qwen3-14B",
    "qwen3-30b-a3b": "Qwen3-30B-A3B",
    "llama-3.2-1b": "Llama-3.2-1B",
    "llama-3.2-3b": "Llama-3.2-3B",
    "llama-3.1-8b": "Llama-3.1-8B",
    "mistral-7b": "Mistral-7B",
    "gpt-oss-20b": "gpt-oss-20b",
}

QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "olmo2", "gemma3"})
EXPLICIT_MASK_MODEL_TYPES = frozenset({"gpt_oss"})


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of a decoder layer: the unit LoRA adapts and bitsandbytes quantizes."""

    name: str
    in_features: int
    out_features: int


@functools.lru_cache(maxsize=256)
def _linear_layers(hidden: int, q_dim: int, kv_dim: int, experts: int, mlp_width: int) -> tuple[LinearLayer, ...]:
    """A decoder layer's linears from its widths (the planner asks for them a million times planning the gallery)."""
    layers = [
        LinearLayer("q_proj", hidden, q_dim),
        LinearLayer("k_proj", hidden, kv_dim),
        LinearLayer("v_proj", hidden, kv_dim),
        LinearLayer("o_proj", q_dim, hidden),
    ]
    if experts:
        layers.append(LinearLayer("router", hidden, experts))
    if mlp_width:
        layers += [
            LinearLayer("gate_proj", hidden, mlp_width),
            LinearLayer("up_proj", hidden, mlp_width),
            LinearLayer("down_proj", mlp_width, hidden),
        ]
    return tuple(layers)


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the planner needs (one decoder-only transformer)."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def needs_explicit_masks(self) -> bool:
        """gpt-oss gets a dense additive mask per layer type (it ignores packed position_ids)."""
        return self.model_type in EXPLICIT_MASK_MODEL_TYPES

    def linear_layers(self) -> tuple[LinearLayer, ...]:
        """The per-layer ``nn.Linear`` modules (what 'all-linear' LoRA adapts); the output head is not one."""
        mlp_width = self.shared_expert_intermediate_size if self.is_moe else self.intermediate_size
        return _linear_layers(self.hidden_size, self.q_dim, self.kv_dim, self.num_experts, mlp_width)

    def linear_params_per_layer(self) -> int:
        return sum(lin.in_features * lin.out_features for lin in self.linear_layers())

    def expert_params_per_layer(self) -> int:
        """3-D expert weights: NF4 under QLoRA (engine.model.quantized_experts), frozen either way."""
        return self.num_experts * 3 * self.hidden_size * self.expert_intermediate_size

    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_params(self) -> int:
        """Input embedding plus output head (counted once when they are tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        per_layer = self.linear_params_per_layer() + self.expert_params_per_layer() + self.norm_params_per_layer()
        return self.num_layers * per_layer + self.embedding_params() + self.hidden_size

    def active_params_per_token(self) -> int:
        """Weights a token multiplies through (MoE: only its experts), output head included."""
        experts = self.experts_per_token * 3 * self.hidden_size * self.expert_intermediate_size
        return self.num_layers * (self.linear_params_per_layer() + experts) + self.vocab_size * self.hidden_size

    def display_name(self) -> str:
        return PRETTY_NAMES.get(self.name, self.name)

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a loaded model, from its transformers config."""
        return cls.from_config_dict(config.to_dict(), getattr(config, "model_type", "model"))

    @classmethod
    def from_config_dict(cls, raw: Mapping[str, Any], name: str) -> ModelShape:
        """Read a Hugging Face ``config.json`` dict (multimodal configs: their ``text_config``)."""
        text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
        assert isinstance(text, Mapping)
        try:
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            model_type = str(text.get("model_type") or raw.get("model_type") or "unknown")
            experts = int(text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0)
            moe_width = int(text.get("moe_intermediate_size") or (text.get("intermediate_size") if experts else 0) or 0)
            return cls(
                name=name,
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
                num_layers=int(text["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                vocab_size=int(text["vocab_size"]),
                tied_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
                qk_norm=model_type in QK_NORM_MODEL_TYPES,
                num_experts=experts,
                experts_per_token=int(text.get("num_experts_per_tok") or 0) if experts else 0,
                expert_intermediate_size=moe_width,
                shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"model config '{name}' lacks a usable field: {err}") from err


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def _shape_from_file(path: Path, label: str) -> ModelShape:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read model config {path}: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    return ModelShape.from_config_dict(raw, label)


def builtin_shape_names() -> list[str]:
    return sorted(BUILTIN_CONFIGS)


def load_shape(model: str) -> ModelShape:
    """A built-in shape name ('llama-3.1-8b', 'Qwen/Qwen3-0.6B'), ``demo`` (the built-in demo model, as
    ``tunedeck train`` takes it), a local model folder, or a config.json path."""
    if model == DEMO_MODEL:
        return _shape_from_file(demo_model_dir() / "config.json", DEMO_MODEL)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return _shape_from_file(path, path.parent.name if path.name == "config.json" else path.stem)
    key = _normalise(model.rsplit("/", 1)[-1]).removeprefix("meta-").removesuffix("-instruct")
    if key in BUILTIN_CONFIGS:
        return ModelShape.from_config_dict(BUILTIN_CONFIGS[key], key)
    raise ConfigError(
        f"unknown model '{model}': not a folder with config.json, not a config file, not a built-in shape",
        hint="built-in shapes: " + ", ".join(builtin_shape_names()),
    )
