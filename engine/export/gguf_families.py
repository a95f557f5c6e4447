"""Model families the GGUF export understands: their llama.cpp architecture, metadata and tensor layout.

Each family maps a transformers ``model_type`` to a GGUF architecture. Tensor names come from the ``gguf``
package's own name maps; what differs per family is the metadata written and a few tensor transforms:
llama-layout models store q/k rows in the interleaved rope order llama.cpp expects (the others use the
"neox" order transformers uses and need no permutation), Gemma stores its norms as ``w - 1``, and MoE models
with fused expert tensors are split into the gate/up/down expert stacks llama.cpp reads. The language halves of
Qwen's picture models are Qwen2 / Qwen3 decoders whose rope is split into sections (time, height, width) for the
image tokens' 2-D positions; llama.cpp reads them as its QWEN2VL / QWEN3VL architectures with those sections.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import TuneDeckError


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool = False  # llama's interleaved rope layout
    norm_plus_one: bool = False  # gemma: RMSNorm weights are stored as (w - 1)
    moe: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("LLAMA", permute_qk=True),
    "mistral": Family("LLAMA", permute_qk=True),
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "phi3": Family("PHI3"),
    "gemma3_text": Family("GEMMA3", norm_plus_one=True),
    "qwen2_vl_text": Family("QWEN2VL"),  # the language halves of picture models (engine.export.vision_gguf)
    "qwen2_5_vl_text": Family("QWEN2VL"),
    "qwen3_vl_text": Family("QWEN3VL"),
    "qwen3_moe": Family("QWEN3MOE", moe=True),
    "olmoe": Family("OLMOE", moe=True),
    "gpt_oss": Family("GPT_OSS", moe=True),
}


def family_for(model_type: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        raise TuneDeckError(
            f"GGUF export does not support the {model_type!r} model family",
            hint=f"supported families: {', '.join(sorted(FAMILIES))}; export --merged for a safetensors model",
        )
    return family


def check_config(family: Family, config: Any) -> None:
    """Refuse shapes llama.cpp cannot load for this architecture, before anything is written."""
    heads, kv_heads = config.num_attention_heads, _get(config, "num_key_value_heads", config.num_attention_heads)
    if family.arch == "OLMOE" and heads != kv_heads:
        raise TuneDeckError(
            f"llama.cpp's OLMoE needs as many key/value heads as attention heads (this model: {kv_heads} of {heads})"
        )
    if family.arch == "GEMMA3":
        _check_gemma3_attention_scale(config)
    if family.arch in ("QWEN2VL", "QWEN3VL") and not rope_parameters(config).get("mrope_section"):
        raise TuneDeckError(f"llama.cpp's {family.arch} needs the rope's sections (mrope_section); this model has none")


def _check_gemma3_attention_scale(config: Any) -> None:
    """llama.cpp scales Gemma 3's attention by its head size, or by hidden size / heads in the 62-layer (27B) model,
    and reads no query_pre_attn_scalar; Gemma 3's own models match that."""
    scalar = _get(config, "query_pre_attn_scalar")
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    assumed = int(config.hidden_size) // heads if layers == 62 else head_dim(config)
    if scalar is not None and int(scalar) != assumed:
        raise TuneDeckError(
            f"llama.cpp scales this Gemma 3's attention by 1/sqrt({assumed}); the model by 1/sqrt({scalar}) "
            "(query_pre_attn_scalar)"
        )


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def head_dim(config: Any) -> int:
    return int(_get(config, "head_dim", config.hidden_size // config.num_attention_heads))


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings in one dict, whether the config keeps them in rope_parameters or the older fields."""
    params = dict(_get(config, "rope_parameters", {}) or {})
    if isinstance(params.get("full_attention"), dict):  # per-layer-type rope (gemma3): the global layers' rope
        params = dict(params["full_attention"])
    scaling = _get(config, "rope_scaling", {}) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", _get(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def add_metadata(writer: Any, family: Family, config: Any) -> None:
    """The hyperparameters llama.cpp reads for this family."""
    import gguf

    dim = head_dim(config)
    rope = rope_parameters(config)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(_get(config, "num_key_value_heads", config.num_attention_heads)))
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(int(dim * float(_get(config, "partial_rotary_factor", 1.0))))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(_get(config, "rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config.vocab_size))
    kind = rope["rope_type"]
    if kind in ("linear", "yarn") and rope.get("factor"):
        scaling = gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN
        writer.add_rope_scaling_type(scaling)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if rope.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind == "longrope" and rope.get("original_max_position_embeddings"):
        original = int(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(_longrope_attention_factor(config, rope, original))
    if family.arch in ("PHI3", "GEMMA3", "GPT_OSS") and _get(config, "sliding_window"):
        writer.add_sliding_window(int(config.sliding_window))
    if family.moe:
        writer.add_expert_count(int(_get(config, "num_experts", _get(config, "num_local_experts", 0))))
        writer.add_expert_used_count(int(config.num_experts_per_tok))
        writer.add_expert_feed_forward_length(int(_get(config, "moe_intermediate_size", config.intermediate_size)))
    if family.arch == "QWEN3MOE" and _get(config, "norm_topk_prob") is not None:
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    if family.arch in ("QWEN2VL", "QWEN3VL"):
        sections = [int(n) for n in rope["mrope_section"]]
        writer.add_rope_dimension_sections([*sections, 0, 0, 0, 0][:4])  # llama.cpp reads four, the last unused
    if family.arch == "QWEN3VL":  # the tower's extra outputs added to the first layers' (engine.export.vision_gguf)
        writer.add_num_deepstack_layers(int(_get(config, "num_deepstack_layers", 0)))


def _longrope_attention_factor(config: Any, rope: dict[str, Any], original: int) -> float:
    """Phi-3's long-context attention scale: given, or sqrt(1 + ln(scale) / ln(original context))."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    scale = float(rope.get("factor") or config.max_position_embeddings / original)
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def llama3_rope_factors(config: Any) -> np.ndarray | None:
    """Per-frequency divisors for Llama-3.1-style rope scaling (llama.cpp reads them as ``rope_freqs``)."""
    rope = rope_parameters(config)
    if rope["rope_type"] != "llama3":
        return None
    dim = head_dim(config)
    base, factor = float(rope["rope_theta"]), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def extra_tensors(family: Family, config: Any) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors llama.cpp needs that are not weights of the model (rope frequency factors)."""
    factors = llama3_rope_factors(config)
    if factors is not None:
        yield "rope_freqs.weight", factors
    rope = rope_parameters(config)
    if family.arch == "PHI3" and rope["rope_type"] == "longrope":
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """transformers' half-split rope rows -> llama.cpp's interleaved pairs, head by head."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def transform(family: Family, config: Any, name: str, weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(hf-style name, array) pairs to write for one tensor of the merged model."""
    if family.permute_qk and name.endswith("self_attn.q_proj.weight"):
        weight = _permute(weight, int(config.num_attention_heads))
    elif family.permute_qk and name.endswith("self_attn.k_proj.weight"):
        weight = _permute(weight, int(_get(config, "num_key_value_heads", config.num_attention_heads)))
    if family.norm_plus_one and name.endswith("norm.weight"):
        weight = weight + 1.0
    if family.arch == "GPT_OSS" and ".mlp.experts." in name:
        yield from _gpt_oss_experts(name, weight)
        return
    if family.moe and name.endswith("mlp.experts.gate_up_proj"):
        gate, up = np.split(weight, 2, axis=1)
        yield name.replace("gate_up_proj", "gate_proj"), gate
        yield name.replace("gate_up_proj", "up_proj"), up
        return
    yield name, weight


def _gpt_oss_experts(name: str, weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """gpt-oss keeps experts as (in, out) with gate and up interleaved; llama.cpp wants (out, in) stacks."""
    stem = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        yield f"{stem}.gate_proj", weight[..., ::2].transpose(0, 2, 1)
        yield f"{stem}.up_proj", weight[..., 1::2].transpose(0, 2, 1)
    elif name.endswith("gate_up_proj_bias"):
        yield f"{stem}.gate_proj.bias", weight[..., ::2]
        yield f"{stem}.up_proj.bias", weight[..., 1::2]
    elif name.endswith("down_proj"):
        yield f"{stem}.down_proj", weight.transpose(0, 2, 1)
    elif name.endswith("down_proj_bias"):
        yield f"{stem}.down_proj.bias", weight
    else:
        yield name, weight


def gguf_name(name_map: Any, name: str) -> str | None:
    """The GGUF tensor name for an hf-style name, or None for tensors llama.cpp does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    gguf: str | None = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
    return gguf
