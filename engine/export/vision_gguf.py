"""GGUF export of a vision-language fine-tune for llama.cpp: the language model plus its vision projector file.

llama.cpp runs a picture model as two files: the language model (a text GGUF, written by engine.export.gguf's
writer from the merged model's language half) and the multimodal projector, ``mmproj-<name>.gguf``, holding the
vision tower and the connector under llama.cpp's ``clip`` architecture. Each model type has its projector writer
(``PROJECTORS``): what in a model of it llama.cpp could not run, the metadata llama.cpp's clip loader reads for it
(the tower's shape, the projector type and the family's own keys) and its tensors under llama.cpp's names (the
``gguf`` package's MMPROJ name map, with the changes llama.cpp's own converter makes: Qwen's 3-D patch embedding
split into its two temporal halves and its fused q/k/v split, Gemma's soft-embedding norm stored as ``1 + w``).
Norms, biases and the patch and position embeddings stay float32 and the other matrices are float16 (float32 for
an f32 export), much as llama.cpp's own converter writes them.

Written this way: Idefics3 / SmolVLM (llama.cpp's idefics3 projector needs a pixel shuffle of 2 or more),
Qwen2-VL and Qwen2.5-VL (their language half as llama.cpp's QWEN2VL, the rope in sections), Qwen3-VL (with its
deepstack layers; the language half as QWEN3VL) and Gemma 3 (SigLIP, pooled to its tokens per image). Llama 3.2
Vision is refused with why: llama.cpp does not run it.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import TuneDeckError
from engine.vision.families import GEMMA3, IDEFICS3, MLLAMA, QWEN_VL, VisionFamily

GGUF_FAMILIES = (IDEFICS3, QWEN_VL, GEMMA3)
"""Families whose vision projector TuneDeck writes for llama.cpp."""

NOT_IN_LLAMA_CPP = {
    MLLAMA.label: "llama.cpp does not run Llama 3.2 Vision: its multimodal library (mtmd) has no mllama projector "
    "and its language models have no cross-attention layers to read the image through",
}
"""Families llama.cpp has no support for at all, and why (checked against llama.cpp's tools/mtmd/clip.cpp)."""

README = """# {name}: GGUF for llama.cpp, with its vision projector

Fine-tuned from `{base}` with TuneDeck ({steps} steps, last loss {loss}). {weights}

- `{gguf}`: the language model ({quant}; {types})
- `{mmproj}`: the vision tower and projector (llama.cpp's `clip` file)

Both files are needed: the language model alone answers without seeing the picture.

    llama-mtmd-cli -m {gguf} --mmproj {mmproj} --image picture.png -p "What is in the picture?"
    llama-server -m {gguf} --mmproj {mmproj}

No Ollama Modelfile is written for picture models.
"""


def refuse_gguf(family: VisionFamily, why: str = "") -> TuneDeckError:
    known = ", ".join(f.label for f in GGUF_FAMILIES)
    reason = (
        why
        or NOT_IN_LLAMA_CPP.get(family.label)
        or (
            f"TuneDeck writes llama.cpp's vision projector file (mmproj) for {known} only, and a GGUF of the language "
            "model alone would answer without seeing the image"
        )
    )
    hint = (
        "export the merged model (--merged) to run it with transformers"
        if family.label in NOT_IN_LLAMA_CPP
        else "export the merged model (--merged), then convert it with llama.cpp's convert_hf_to_gguf.py, once "
        "as the model and once with --mmproj, where llama.cpp supports the model"
    )
    return TuneDeckError(f"{family.label} models are not exported to GGUF here: {reason}", hint=hint)


def check_gguf_family(family: VisionFamily, config: dict[str, Any] | None) -> None:
    """Refuse, before the slow merge, a family (or a model of it) whose projector llama.cpp could not load.
    ``config``: the model's config.json (None where it cannot be read: the merged model is checked instead)."""
    if family not in GGUF_FAMILIES:
        raise refuse_gguf(family)
    if config is None:
        return
    from transformers import AutoConfig

    try:  # the class defaults for what the file leaves out
        model_config = AutoConfig.for_model(**config)
    except Exception:  # the merge reports an unreadable config with its own error
        return
    check_model(family, model_config)


def check_model(family: VisionFamily, config: Any) -> None:
    """Refuse a model (its transformers config) whose projector llama.cpp could not run, saying why."""
    projector = PROJECTORS.get(config.model_type)
    if projector is None:
        raise refuse_gguf(family, f"TuneDeck writes no llama.cpp projector for the model type {config.model_type!r}")
    why = projector.refusal(config)
    if why:
        raise refuse_gguf(family, why)


# ------------------------------------------------------------------------------------------- the language half


@dataclass(frozen=True)
class LanguageHalf:
    """The merged picture model's language half as engine.export.gguf's writer reads a causal language model: the
    text config and the tensors under a causal LM's names (``model.*``, ``lm_head.weight``), sharing the weights.
    (Qwen's language halves have no causal LM class of their own in transformers.)"""

    config: Any
    tensors: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.tensors


def language_model(model: Any, family: VisionFamily) -> LanguageHalf:
    """The language half of the merged ``model``: its text config (a copy saying whether the output head is the
    embedding, and for Qwen3-VL how many deepstack layers feed it) and its tensors."""
    prefix = family.language[0] + "."
    state = {
        "model." + key.removeprefix(prefix): value
        for key, value in model.state_dict().items()
        if key.startswith(prefix)
    }
    state["lm_head.weight"] = model.lm_head.weight
    config = copy.deepcopy(model.config.text_config)
    config.tie_word_embeddings = state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    deepstack = getattr(model.config.vision_config, "deepstack_visual_indexes", None)
    if deepstack is not None:
        config.num_deepstack_layers = len(deepstack)
    return LanguageHalf(config, state)


# ------------------------------------------------------------------------------------------ projector writers


@dataclass(frozen=True)
class Projector:
    """How the vision tower and connector of one model type become llama.cpp's projector file."""

    refusal: Callable[[Any], str]
    """(model config) -> why llama.cpp could not run this model's projector; "" where it can."""
    metadata: Callable[[Any, Any, Any], None]
    """(writer, model config, image processor): the projector type, the tower's shape and the family's own keys."""
    tensors: Callable[[Any, Any], Iterator[tuple[str, Any]]]
    """(model, name map) -> (llama.cpp name, float32 array) of the tower and the connector."""


def _add_tower(writer: Any, vision: Any, width: int, ffn: int, eps: float, image_size: int) -> None:
    """The vision tower's shape as llama.cpp reads it (every projector type needs all of it)."""
    writer.add_vision_embedding_length(width)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(int(vision.num_hidden_layers))
    writer.add_vision_head_count(int(vision.num_attention_heads))
    writer.add_vision_attention_layernorm_eps(eps)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(int(vision.patch_size))


def _arrays(model: Any, prefixes: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    for key, tensor in model.state_dict().items():
        if key.startswith(prefixes):
            yield key, tensor.detach().float().cpu().numpy()


def _mapped(names: Any, key: str, array: Any) -> tuple[str, Any]:
    target = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if target is None:
        raise TuneDeckError(f"GGUF export cannot place the vision tensor {key!r} in llama.cpp's projector file")
    return target, array


# Idefics3 / SmolVLM: SigLIP, a pixel shuffle and one linear layer.


def _idefics3_refusal(config: Any) -> str:
    scale = int(config.scale_factor)
    if scale < 2:
        return (
            f"llama.cpp's idefics3 projector needs a pixel shuffle (scale_factor) of 2 or more, this model has {scale}"
        )
    return ""


def _idefics3_metadata(writer: Any, config: Any, images: Any) -> None:
    import gguf

    vision = config.vision_config
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    _add_tower(writer, vision, int(vision.hidden_size), int(vision.intermediate_size), float(vision.layer_norm_eps),
               int(vision.image_size))  # fmt: skip
    writer.add_vision_projector_scale_factor(int(config.scale_factor))
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(int(images.size["longest_edge"]))


def _idefics3_tensors(model: Any, names: Any) -> Iterator[tuple[str, Any]]:
    for key, array in _arrays(model, ("model.vision_model.", "model.connector.")):
        yield _mapped(names, key, array)


# Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a ViT on 14- or 16-pixel patches with 2-D rope, whose 2x2 neighbours are merged
# into one token by an MLP. llama.cpp's graphs fix the 2x2 merge, two frames a patch and (Qwen2.5-VL) 112-pixel
# attention windows.


def _qwen_refusal(config: Any, act: str) -> str:
    vision = config.vision_config
    if int(vision.spatial_merge_size) != 2 or int(vision.temporal_patch_size) != 2:
        return (
            "llama.cpp's Qwen-VL projectors merge 2x2 patches of 2 frames; this model merges "
            f"{vision.spatial_merge_size}x{vision.spatial_merge_size} patches of {vision.temporal_patch_size} frames"
        )
    if vision.hidden_act != act:
        return f"llama.cpp's projector of this model type uses the {act} activation, this tower {vision.hidden_act}"
    return ""


def _qwen2_refusal(config: Any) -> str:
    return _qwen_refusal(config, "quick_gelu")


def _qwen25_refusal(config: Any) -> str:
    vision = config.vision_config
    full = [int(i) for i in vision.fullatt_block_indexes]
    every = full[0] + 1 if full else 0
    if not every or {i for i in range(int(vision.depth)) if (i + 1) % every == 0} != set(full):
        return (
            "llama.cpp's qwen2.5vl projector attends over the whole picture in every n-th layer, this model in "
            f"layers {full} of {vision.depth}"
        )
    if int(vision.window_size) != 112:
        return f"llama.cpp's qwen2.5vl projector uses 112-pixel attention windows, this model {vision.window_size}"
    return _qwen_refusal(config, "silu")


def _qwen3_refusal(config: Any) -> str:
    vision, rope = config.vision_config, config.text_config.rope_parameters or {}
    deepstack = [int(i) for i in vision.deepstack_visual_indexes]
    if deepstack != sorted(deepstack):
        return f"llama.cpp's qwen3vl projector adds the deepstack layers in order, this model lists {deepstack}"
    if not rope.get("mrope_interleaved", False):
        return "llama.cpp's QWEN3VL language model interleaves the rope sections, this model's are not interleaved"
    if round(int(vision.num_position_embeddings) ** 0.5) ** 2 != int(vision.num_position_embeddings):
        return "llama.cpp's qwen3vl projector needs a square grid of position embeddings"
    return _qwen_refusal(config, "gelu_pytorch_tanh")


def _qwen_metadata(writer: Any, config: Any, images: Any) -> None:
    """Qwen2-VL and Qwen2.5-VL. The image size only sizes llama.cpp's warm-up (560 as its converter writes it):
    llama.cpp resizes a picture to 8 to 4096 tokens itself."""
    import gguf

    vision = config.vision_config
    writer.add_vision_spatial_merge_size(int(vision.spatial_merge_size))
    if config.model_type == "qwen2_vl":  # embed_dim is the tower's width, hidden_size its output
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
        width = int(vision.embed_dim)
        _add_tower(writer, vision, width, int(width * vision.mlp_ratio), 1e-6, 560)
        return
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    _add_tower(writer, vision, int(vision.hidden_size), int(vision.intermediate_size), 1e-6, 560)
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(int(vision.fullatt_block_indexes[0]) + 1)


def _qwen3_metadata(writer: Any, config: Any, images: Any) -> None:
    """Qwen3-VL: its position embeddings are a square grid of 16-pixel patches (the image size), interpolated by
    llama.cpp to a picture's size."""
    import gguf

    vision = config.vision_config
    side = round(int(vision.num_position_embeddings) ** 0.5)
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    _add_tower(writer, vision, int(vision.hidden_size), int(vision.intermediate_size), 1e-6,
               side * int(vision.patch_size))  # fmt: skip
    writer.add_vision_spatial_merge_size(int(vision.spatial_merge_size))
    writer.add_vision_use_gelu(True)
    deepstack = {int(i) for i in vision.deepstack_visual_indexes}
    writer.add_vision_is_deepstack_layers([i in deepstack for i in range(int(vision.depth))])


def _patch_halves(array: Any) -> Iterator[tuple[str, Any]]:
    """The 3-D patch embedding (out, channels, 2 frames, h, w) as llama.cpp's two 2-D convolutions, one a frame: a
    still picture is both frames."""
    yield "v.patch_embd.weight", array[:, :, 0]
    yield "v.patch_embd.weight.1", array[:, :, 1]


QWEN2_MERGER = {"ln_q": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2"}
"""The merger's norm and MLP under llama.cpp's names (the name map numbers the MLP's layers as blocks)."""


def _qwen_tensors(model: Any, names: Any) -> Iterator[tuple[str, Any]]:
    """Qwen2-VL and Qwen2.5-VL: q, k and v are separate tensors in llama.cpp's qwen2vl graph."""
    import numpy as np

    for key, array in _arrays(model, ("model.visual.",)):
        key = key.removeprefix("model.")
        if key == "visual.patch_embed.proj.weight":
            yield from _patch_halves(array)
        elif key.startswith("visual.merger."):
            part, suffix = key.removeprefix("visual.merger.").rsplit(".", 1)
            yield f"{QWEN2_MERGER[part]}.{suffix}", array
        elif ".attn.qkv." in key:
            for part, rows in zip("qkv", np.split(array, 3), strict=True):
                yield _mapped(names, key.replace(".qkv.", f".{part}."), rows)
        else:
            yield _mapped(names, key, array)


QWEN3_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
QWEN3_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
"""Qwen3-VL's merger and deepstack mergers under llama.cpp's names (``v.deepstack.<tower layer>.<part>``)."""


def _qwen3_tensors(model: Any, names: Any) -> Iterator[tuple[str, Any]]:
    """Qwen3-VL: the merger under the Qwen2-VL names, each deepstack merger under the tower layer it reads."""
    deepstack = [int(i) for i in model.config.vision_config.deepstack_visual_indexes]
    for key, array in _arrays(model, ("model.visual.",)):
        key = key.removeprefix("model.")
        if key == "visual.patch_embed.proj.weight":
            yield from _patch_halves(array)
        elif key == "visual.patch_embed.proj.bias":
            yield "v.patch_embd.bias", array
        elif key.startswith("visual.merger."):
            part, suffix = key.removeprefix("visual.merger.").split(".")
            yield f"{QWEN3_MERGER[part]}.{suffix}", array
        elif key.startswith("visual.deepstack_merger_list."):
            index, part, suffix = key.removeprefix("visual.deepstack_merger_list.").split(".")
            yield f"v.deepstack.{deepstack[int(index)]}.{QWEN3_DEEPSTACK[part]}.{suffix}", array
        else:
            yield _mapped(names, key, array)


# Gemma 3: SigLIP, average-pooled to the model's tokens per image, an RMS norm and one matrix.


def _gemma3_kernel(config: Any) -> tuple[int, int]:
    """(patches per side of the picture, their average pool's side) of a Gemma 3 model."""
    vision = config.vision_config
    side = int(vision.image_size) // int(vision.patch_size)
    return side, side // round(int(config.mm_tokens_per_image) ** 0.5)


def _gemma3_refusal(config: Any) -> str:
    side, kernel = _gemma3_kernel(config)
    tokens, act = int(config.mm_tokens_per_image), config.vision_config.hidden_act
    if kernel < 1 or side % kernel or (side // kernel) ** 2 != tokens:
        return f"llama.cpp's gemma3 projector pools {side}x{side} patches evenly into a square, not into {tokens}"
    if act != "gelu_pytorch_tanh":
        return f"llama.cpp's gemma3 projector uses the gelu_pytorch_tanh activation, this model's tower {act}"
    return ""


def _gemma3_metadata(writer: Any, config: Any, images: Any) -> None:
    import gguf

    vision = config.vision_config
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    _add_tower(writer, vision, int(vision.hidden_size), int(vision.intermediate_size), float(vision.layer_norm_eps),
               int(vision.image_size))  # fmt: skip
    writer.add_vision_use_gelu(True)
    writer.add_vision_projector_scale_factor(_gemma3_kernel(config)[1])  # llama.cpp assumes 4 (896 / 14 / 16)


def _gemma3_tensors(model: Any, names: Any) -> Iterator[tuple[str, Any]]:
    for key, array in _arrays(model, ("model.vision_tower.", "model.multi_modal_projector.")):
        key = key.removeprefix("model.")
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            key = key.replace("vision_tower.", "vision_tower.vision_model.", 1)  # the name map's SigLIP, not bare
        if key.startswith("vision_tower.vision_model.head."):
            continue  # SigLIP's pooling head, which Gemma 3 leaves unused
        if key.endswith("_weight"):  # the projection is a bare parameter, mm_input_projection_weight
            key = key.removesuffix("_weight") + ".weight"
        if key.endswith("mm_soft_emb_norm.weight"):
            array = array + 1.0  # Gemma's RMS norm scales by 1 + w, llama.cpp's by the weight it reads
        yield _mapped(names, key, array)


_QWEN2 = Projector(_qwen2_refusal, _qwen_metadata, _qwen_tensors)
_IDEFICS3 = Projector(_idefics3_refusal, _idefics3_metadata, _idefics3_tensors)
PROJECTORS = {
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    "qwen2_vl": _QWEN2,
    "qwen2_5_vl": Projector(_qwen25_refusal, _qwen_metadata, _qwen_tensors),
    "qwen3_vl": Projector(_qwen3_refusal, _qwen3_metadata, _qwen3_tensors),
    "gemma3": Projector(_gemma3_refusal, _gemma3_metadata, _gemma3_tensors),
}
"""The projector writer of each model type TuneDeck exports to llama.cpp."""

F32_TENSORS = ("v.patch_embd", "v.position_embd")
"""Matrices kept in float32 in a float16 file: small, and every patch of a picture goes through them."""


def write_projector(path: Path, model: Any, processor: Any, float32: bool = False) -> None:
    """The vision tower and connector of the merged ``model`` as llama.cpp's ``clip`` GGUF at ``path``."""
    import gguf
    import numpy as np

    config = model.config
    projector, images = PROJECTORS[config.model_type], processor.image_processor
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(path.stem)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if float32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(int(config.text_config.hidden_size))
    writer.add_vision_image_mean([float(v) for v in images.image_mean])
    writer.add_vision_image_std([float(v) for v in images.image_std])
    projector.metadata(writer, config, images)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, int(config.vision_config.num_hidden_layers))
    for name, array in projector.tensors(model, names):
        keep = float32 or array.ndim < 2 or name.startswith(F32_TENSORS)
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32 if keep else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------------------------------ export


def export_vision_gguf(
    run_folder: Path, target: Path, family: VisionFamily, quant: str, overwrite: bool, report: Any, adapter: str
) -> Path:
    """Write ``<name>.gguf`` (the language model in ``quant``) and ``mmproj-<name>.gguf`` with a README to
    ``target``; everything is written to a temporary folder renamed into place at the end."""
    from engine.config import RunConfig
    from engine.export import gguf as text_gguf
    from engine.export import gguf_families
    from engine.export.merged import _commit, _prepare_target, _readme, _run_adapter, merged_model
    from engine.vision.model import model_config_dict

    check_gguf_family(family, model_config_dict(RunConfig.load(run_folder / "config.json").model, on_disk=True))
    chosen = _run_adapter(run_folder, adapter)
    _prepare_target(target, overwrite)  # the usual "not empty" error before the slow merge
    report(text_gguf.ExportProgress("merging", 0, 1, "merging the adapter into the base model"))
    model, processor = merged_model(run_folder, "float32", adapter)
    check_model(family, model.config)
    language = language_model(model, family)
    gguf_families.check_config(gguf_families.family_for(language.config.model_type), language.config)
    tokenizer = processor.tokenizer
    if not getattr(tokenizer, "chat_template", None):  # the template may live on the processor alone (Gemma 3)
        tokenizer.chat_template = processor.chat_template
    report(text_gguf.ExportProgress("merging", 1, 1))
    name = text_gguf.model_slug(run_folder.name)
    tmp = _prepare_target(target, overwrite)
    try:
        tmp.mkdir(parents=True)
        text_gguf._write_model(tmp / f"{name}.gguf", language, tokenizer, quant, report)
        path, types = text_gguf._checked_name(tmp / f"{name}.gguf", quant, report)
        report(text_gguf.ExportProgress("writing", 0, 1, "vision projector"))
        projector = tmp / f"mmproj-{name}.gguf"
        write_projector(projector, model, processor, float32=quant == "f32")
        readme = _readme(
            README, run_folder, target, chosen, quant=quant, gguf=path.name, mmproj=projector.name,
            types=types.summary(),
        )  # fmt: skip
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        report(text_gguf.ExportProgress("writing", 1, 1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(tmp, target)
