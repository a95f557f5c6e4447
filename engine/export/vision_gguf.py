"""GGUF export of a vision-language fine-tune for llama.cpp: the language model plus its vision projector file.

llama.cpp runs a picture model as two files: the language model (a text GGUF, written by engine.export.gguf's
writer from the merged model's language half) and the multimodal projector, ``mmproj-<name>.gguf``, holding the
vision tower and the connector under llama.cpp's ``clip`` architecture. The projector's tensor names come from the
``gguf`` package's MMPROJ name map; its metadata is the set llama.cpp's clip loader reads for the family (the tower's
shape, the image mean and std, the preprocessor's longest edge, the projector type and the pixel-shuffle scale).
Embeddings, norms and biases stay float32 and the tower's matrices are float16 (float32 for an f32 export), as
llama.cpp's own converter writes them. Idefics3 / SmolVLM is written this way; the other families are refused with
why. llama.cpp's idefics3 projector needs a pixel shuffle of 2 or more (SmolVLM's own models use 2 to 4).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from engine.errors import TuneDeckError
from engine.vision.families import IDEFICS3, VisionFamily

GGUF_FAMILIES = (IDEFICS3,)
"""Families whose vision projector TuneDeck writes for llama.cpp."""

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
    reason = why or (
        f"TuneDeck writes llama.cpp's vision projector file (mmproj) for {known} only, and a GGUF of the language "
        "model alone would answer without seeing the image"
    )
    return TuneDeckError(
        f"{family.label} models are not exported to GGUF here: {reason}",
        hint="export the merged model (--merged), then convert it with llama.cpp's convert_hf_to_gguf.py, once "
        "as the model and once with --mmproj, where llama.cpp supports the family",
    )


def check_gguf_family(family: VisionFamily, config: dict[str, Any] | None) -> None:
    """Refuse, before the slow merge, a family (or a model of it) whose projector llama.cpp could not load."""
    if family not in GGUF_FAMILIES:
        raise refuse_gguf(family)
    scale = int((config or {}).get("scale_factor", 2))
    if scale < 2:
        raise refuse_gguf(
            family,
            f"llama.cpp's idefics3 projector needs a pixel shuffle (scale_factor) of 2 or more, this model has {scale}",
        )


def language_model(model: Any) -> Any:
    """The merged picture model's language half as a causal language model (Idefics3: ``model.text_model`` and
    ``lm_head``), sharing its weights."""
    from transformers import AutoModelForCausalLM

    text_config = model.config.text_config
    head, embeddings = model.lm_head.weight, model.model.text_model.embed_tokens.weight
    text_config.tie_word_embeddings = head.data_ptr() == embeddings.data_ptr()
    language = AutoModelForCausalLM.from_config(text_config)
    state = {
        "model." + key.removeprefix("model.text_model."): value
        for key, value in model.state_dict().items()
        if key.startswith("model.text_model.")
    }
    state["lm_head.weight"] = model.lm_head.weight
    language.load_state_dict(state, strict=True, assign=True)
    language.generation_config = model.generation_config
    return language.eval()


def _projector_tensors(model: Any, float32: bool) -> list[tuple[str, Any]]:
    """(gguf name, array) of the vision tower and connector, in the model's order."""
    import gguf
    import numpy as np

    vision = model.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, int(vision.num_hidden_layers))
    found = []
    for key, tensor in model.state_dict().items():
        if not key.startswith(("model.vision_model.", "model.connector.")):
            continue
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise TuneDeckError(f"GGUF export cannot place the vision tensor {key!r} in llama.cpp's projector file")
        array = tensor.detach().float().cpu().numpy()
        keep = float32 or array.ndim < 2 or ".embeddings." in key
        found.append((target, array.astype(np.float32 if keep else np.float16)))
    return found


def write_projector(path: Path, model: Any, processor: Any, float32: bool = False) -> None:
    """The Idefics3 / SmolVLM vision tower and connector as llama.cpp's ``clip`` GGUF at ``path``."""
    import gguf

    config, vision = model.config, model.config.vision_config
    images = processor.image_processor
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(path.stem)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if float32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_projection_dim(int(config.text_config.hidden_size))
    writer.add_vision_image_size(int(vision.image_size))
    writer.add_vision_patch_size(int(vision.patch_size))
    writer.add_vision_embedding_length(int(vision.hidden_size))
    writer.add_vision_feed_forward_length(int(vision.intermediate_size))
    writer.add_vision_block_count(int(vision.num_hidden_layers))
    writer.add_vision_head_count(int(vision.num_attention_heads))
    writer.add_vision_attention_layernorm_eps(float(vision.layer_norm_eps))
    writer.add_vision_image_mean([float(v) for v in images.image_mean])
    writer.add_vision_image_std([float(v) for v in images.image_std])
    writer.add_vision_projector_scale_factor(int(config.scale_factor))
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(int(images.size["longest_edge"]))
    for name, array in _projector_tensors(model, float32):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    language = language_model(model)
    gguf_families.check_config(gguf_families.family_for(language.config.model_type), language.config)
    report(text_gguf.ExportProgress("merging", 1, 1))
    name = text_gguf.model_slug(run_folder.name)
    tmp = _prepare_target(target, overwrite)
    try:
        tmp.mkdir(parents=True)
        text_gguf._write_model(tmp / f"{name}.gguf", language, processor.tokenizer, quant, report)
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
