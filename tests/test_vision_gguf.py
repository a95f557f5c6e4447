"""GGUF export of a picture fine-tune, a family at a time (Idefics3 / SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Gemma 3): the language model and llama.cpp's vision projector file read back with the names, shapes and metadata
llama.cpp's loaders expect, and llama.cpp (through llama-cpp-python) loads both and encodes a picture into the same
image embeddings as the merged model in transformers. A family llama.cpp cannot run is refused before the merge,
saying why.

Each family's picture has a size that transformers' processor and llama.cpp's preprocessing both keep as it is
(they resize differently): Idefics3 tiles of 32 pixels, Gemma 3's 32-pixel square, and for Qwen a multiple of the
merged patch (28 pixels, 32 for Qwen3-VL) between llama.cpp's floor of 8 tokens and the processor's pixel budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_S
from test_vision_train import colour_rows, config
from vision_models import build_vision_model

from engine.events import RunFinished
from engine.export.to_gguf import export_gguf
from engine.train import run

ENCODE = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
from llama_cpp import mtmd_cpp as M

model_path, projector, picture = sys.argv[1:4]
llm = llama_cpp.Llama(model_path, n_ctx=256, verbose=False)
params = M.mtmd_context_params_default()
params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
ctx = M.mtmd_init_from_file(projector.encode(), llm.model, params)
assert ctx and M.mtmd_support_vision(ctx)
bitmap = M.mtmd_helper_bitmap_init_from_file(ctx, picture.encode(), False)
prompt = ("User:" + M.mtmd_default_marker().decode() + "colour?").encode()
text = M.mtmd_input_text(prompt, len(prompt), True, True)
chunks = M.mtmd_input_chunks_init()
assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
width = llama_cpp.llama_model_n_embd_inp(llm.model)  # the text width, times 1 + the deepstack layers (Qwen3-VL)
slices = []
for i in range(M.mtmd_input_chunks_size(chunks)):
    chunk = M.mtmd_input_chunks_get(chunks, i)
    if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
        count = M.mtmd_input_chunk_get_n_tokens(chunk)
        assert M.mtmd_encode_chunk(ctx, chunk) == 0
        slices.append(np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(count, width)).tolist())
print(json.dumps(slices))
"""

LOGITS = r"""
import json, sys
import llama_cpp

llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, logits_all=True, verbose=False)
ids = json.loads(sys.argv[2])
llm.eval(ids)
print(json.dumps([[float(x) for x in row] for row in llm.scores[: len(ids)]]))
"""


@dataclass(frozen=True)
class Case:
    """One family's tiny model, its picture, and what its two GGUF files must hold."""

    family: str
    picture: tuple[int, int]
    """(width, height) of the picture encoded."""
    arch: str
    """The language model's llama.cpp architecture."""
    language: dict[str, Any]
    """Some of the language model's metadata."""
    projector: dict[str, Any]
    """Some of the projector file's metadata."""
    shapes: dict[str, tuple[int, ...]]
    """Some of the projector's tensors, in the shapes transformers holds them."""
    tensors: int
    """How many tensors the projector file holds."""
    embeddings: tuple[int, ...]
    """(slices, tokens, width) of the picture's embeddings."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The tiny model's own (tests/vision_models.py)."""


CASES = {
    "idefics3": Case(
        "idefics3",
        picture=(64, 64),
        arch="llama",
        language={"llama.block_count": 2},
        projector={
            "clip.projector_type": "idefics3",
            "clip.vision.projector.scale_factor": 2,
            "clip.vision.image_size": 32,
            "clip.vision.patch_size": 8,
            "clip.vision.image_mean": [0.5, 0.5, 0.5],
            "clip.vision.preproc_image_size": 64,
        },
        shapes={
            "v.patch_embd.weight": (32, 3, 8, 8),
            "v.position_embd.weight": (16, 32),
            "v.blk.0.attn_q.weight": (32, 32),
            "v.blk.0.ffn_up.weight": (64, 32),
            "v.post_ln.weight": (32,),
            "mm.model.fc.weight": (64, 128),  # 32 x 2 x 2 after the pixel shuffle, into the text width
        },
        tensors=22,
        embeddings=(5, 4, 64),  # four 32-pixel tiles of the 64-pixel picture and the whole picture
        settings={"scale_factor": 2},  # SmolVLM's pixel shuffle
    ),
    "qwen2_vl": Case(
        "qwen2_vl",
        picture=(112, 112),
        arch="qwen2vl",
        language={"qwen2vl.rope.dimension_sections": [2, 3, 3, 0]},
        projector={
            "clip.projector_type": "qwen2vl_merger",
            "clip.vision.spatial_merge_size": 2,
            "clip.vision.patch_size": 14,
            "clip.vision.feed_forward_length": 64,
        },
        shapes={
            "v.patch_embd.weight": (32, 3, 14, 14),  # a frame of the 3-D patch embedding each
            "v.patch_embd.weight.1": (32, 3, 14, 14),
            "v.blk.0.attn_q.weight": (32, 32),  # split from the fused q, k, v
            "v.blk.0.attn_v.bias": (32,),
            "v.blk.0.ffn_up.weight": (64, 32),
            "v.post_ln.bias": (32,),
            "mm.0.weight": (128, 128),  # 2 x 2 patches merged
            "mm.2.weight": (64, 128),
        },
        tensors=24,
        embeddings=(1, 16, 64),
        settings={"rms_norm_eps": 1e-6},  # Qwen's own; the llama.cpp built here reads none for qwen2vl, using 0
    ),
    "qwen2_5_vl": Case(
        "qwen2_5_vl",
        picture=(224, 112),  # two 112-pixel attention windows, layer 0 attending within them and layer 1 not
        arch="qwen2vl",
        language={"qwen2vl.rope.dimension_sections": [2, 3, 3, 0]},
        projector={
            "clip.projector_type": "qwen2.5vl_merger",
            "clip.vision.n_wa_pattern": 2,
            "clip.use_silu": True,
            "clip.vision.block_count": 2,
        },
        shapes={
            "v.patch_embd.weight.1": (32, 3, 14, 14),
            "v.blk.1.attn_k.weight": (32, 32),
            "v.blk.1.ffn_gate.weight": (64, 32),
            "v.post_ln.weight": (32,),
            "mm.2.weight": (64, 128),
        },
        tensors=39,
        embeddings=(1, 32, 64),
        settings={"depth": 2, "full_attention": (1,), "max_pixels": 224 * 112, "rms_norm_eps": 1e-6},
    ),
    "qwen3_vl": Case(
        "qwen3_vl",
        picture=(128, 128),  # the 8 x 8 grid of the position embeddings, as trained
        arch="qwen3vl",
        language={"qwen3vl.rope.dimension_sections": [2, 3, 3, 0], "qwen3vl.n_deepstack_layers": 1},
        projector={
            "clip.projector_type": "qwen3vl_merger",
            "clip.vision.is_deepstack_layers": [True, False],
            "clip.vision.image_size": 128,
            "clip.use_gelu": True,
        },
        shapes={
            "v.patch_embd.bias": (32,),
            "v.position_embd.weight": (64, 32),
            "v.blk.0.attn_qkv.weight": (96, 32),
            "v.post_ln.weight": (32,),
            "v.deepstack.0.norm.weight": (128,),
            "v.deepstack.0.fc2.weight": (64, 128),
            "mm.0.weight": (128, 128),
        },
        tensors=40,
        embeddings=(1, 16, 128),  # the merged tokens beside the deepstack layer's
    ),
    "gemma3": Case(
        "gemma3",
        picture=(32, 32),
        arch="gemma3",
        language={"gemma3.block_count": 2},
        projector={
            "clip.projector_type": "gemma3",
            "clip.vision.projector.scale_factor": 2,  # 4 x 4 patches pooled to 2 x 2 tokens
            "clip.vision.image_size": 32,
            "clip.use_gelu": True,
        },
        shapes={
            "v.patch_embd.bias": (32,),
            "v.position_embd.weight": (16, 32),
            "v.blk.0.ffn_down.weight": (32, 64),
            "mm.soft_emb_norm.weight": (32,),
            "mm.input_projection.weight": (32, 64),
        },
        tensors=23,
        embeddings=(1, 4, 64),
        settings={"projector_std": 0.2},  # not transformers' zeros, which would make every picture the same
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Case, Path, Path]:
    """(case, run folder, GGUF folder) of a two-step run of the case's tiny model, exported in float16."""
    case = CASES[request.param]
    folder = tmp_path_factory.mktemp(case.family)
    model = build_vision_model(folder / "model", case.family, **case.settings)
    events = list(run(config(model, colour_rows(folder), folder / "runs", max_steps=2, learning_rate=5e-2)))
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    return case, Path(finished.run_dir), export_gguf(finished.run_dir, folder / "gguf", quant="f16")


def fields(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(metadata, tensor name -> shape as transformers holds it) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    return meta, {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}


def test_the_language_model_and_its_projector_read_back_as_llama_cpp_expects(
    exported: tuple[Case, Path, Path],
) -> None:
    case, _, folder = exported
    model, projector = folder / "vision.gguf", folder / "mmproj-vision.gguf"
    assert model.exists() and projector.exists()
    assert "llama-mtmd-cli -m vision.gguf --mmproj mmproj-vision.gguf --image" in (folder / "README.md").read_text()
    meta, shapes = fields(model)
    assert meta["general.architecture"] == case.arch and {key: meta.get(key) for key in case.language} == case.language
    assert shapes["token_embd.weight"][1] == 64 and not any(name.startswith(("v.", "mm.")) for name in shapes)
    meta, shapes = fields(projector)
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.has_vision_encoder"] is True and meta["clip.vision.projection_dim"] == 64
    assert {key: meta.get(key) for key in case.projector} == case.projector
    assert {name: shapes.get(name) for name in case.shapes} == case.shapes
    assert len(shapes) == case.tensors, sorted(shapes)


def test_llama_cpp_encodes_a_picture_as_the_merged_model_does(
    exported: tuple[Case, Path, Path], tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp", reason="llama-cpp-python without llama.cpp's multimodal library")
    import numpy as np
    from vision_models import draw

    case, run_dir, folder = exported
    picture = draw(tmp_path / "red.png", (220, 20, 20), size=case.picture)
    args = [sys.executable, "-c", ENCODE, str(folder / "vision.gguf"), str(folder / "mmproj-vision.gguf"), str(picture)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=HANG_S)  # a llama.cpp abort fails the test
    assert done.returncode == 0, done.stderr[-3000:]
    slices = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
    assert slices.shape == case.embeddings
    expected = merged_image_features(run_dir, picture).reshape(slices.shape)
    scale = float(np.abs(expected).max())  # the tower's matrices are float16 in the file: 1e-3 of the largest value
    np.testing.assert_allclose(slices, expected, rtol=0, atol=2e-3 * scale)


def test_llama_cpp_runs_the_language_model_on_text_as_the_merged_model_does(
    exported: tuple[Case, Path, Path],
) -> None:
    """The language half alone (Qwen: llama.cpp's QWEN2VL / QWEN3VL, whose rope sections all take a text token's
    one position)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import numpy as np
    import torch

    from engine.export.merged import merged_model
    from engine.vision.encode import render

    _, run_dir, folder = exported
    model, processor = merged_model(run_dir, "float32")
    chat = [{"role": "user", "content": "Which colour is the sky?"}, {"role": "assistant", "content": "blue"}]
    ids = processor.tokenizer(render(processor, chat, prompt=False), add_special_tokens=False)["input_ids"]
    args = [sys.executable, "-c", LOGITS, str(folder / "vision.gguf"), json.dumps(ids)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    found = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert found.shape == expected.shape
    assert np.abs(found - expected).max() <= 0.02 * np.abs(expected).max()  # f16 weights and activations


def merged_image_features(run_dir: Path, picture: Path) -> Any:
    """The image embeddings of ``picture`` by the run's merged model in transformers, as the language model
    receives them (Qwen3-VL: the merged tokens beside each deepstack layer's), a row a token."""
    import torch
    from PIL import Image

    from engine.export.merged import merged_model
    from engine.vision.encode import render

    model, processor = merged_model(run_dir, "float32")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = render(processor, messages, prompt=True)
    inputs = processor(text=[text], images=[[Image.open(picture).convert("RGB")]], return_tensors="pt")
    pixels = {key: value for key, value in inputs.items() if key.startswith(("pixel_", "image_grid"))}
    with torch.no_grad():
        features = model.model.get_image_features(**pixels)
    parts = [getattr(features, "pooler_output", features), *(getattr(features, "deepstack_features", None) or [])]
    rows = [part if isinstance(part, torch.Tensor) else torch.cat(list(part)) for part in parts]
    return torch.cat([row.reshape(-1, row.shape[-1]) for row in rows], dim=-1).numpy()


@pytest.mark.parametrize(
    ("family", "settings", "why"),
    [
        ("mllama", {}, "no mllama projector"),
        ("idefics3", {}, r"pixel shuffle \(scale_factor\) of 2 or more"),
        ("qwen2_5_vl", {"depth": 2, "full_attention": (0,)}, r"every n-th layer, this model in layers \[0\] of 2"),
    ],
)
def test_a_model_llama_cpp_cannot_run_is_refused_before_the_merge_saying_why(
    family: str, settings: dict[str, Any], why: str, tmp_path: Path
) -> None:
    from engine.errors import TuneDeckError
    from engine.export.vision_gguf import check_gguf_family
    from engine.vision.families import family_of

    raw = json.loads((build_vision_model(tmp_path / family, family, **settings) / "config.json").read_text())
    with pytest.raises(TuneDeckError, match=why) as caught:
        check_gguf_family(family_of(raw), raw)
    assert "not exported to GGUF" in str(caught.value) and "--merged" in (caught.value.hint or "")


def test_a_gemma3_whose_attention_scale_llama_cpp_would_not_use_is_refused() -> None:
    from transformers import Gemma3TextConfig

    from engine.errors import TuneDeckError
    from engine.export import gguf_families

    family = gguf_families.family_for("gemma3_text")
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
    gguf_families.check_config(family, Gemma3TextConfig(**shape, query_pre_attn_scalar=16))
    with pytest.raises(TuneDeckError, match=r"by 1/sqrt\(16\); the model by 1/sqrt\(256\)"):
        gguf_families.check_config(family, Gemma3TextConfig(**shape, query_pre_attn_scalar=256))


def test_installing_a_picture_model_into_ollama_or_lm_studio_says_why_not(exported: tuple[Case, Path, Path]) -> None:
    from engine.errors import TuneDeckError
    from engine.export.install import read_export

    with pytest.raises(TuneDeckError, match="installs text models only") as caught:
        read_export(exported[2])
    assert "--mmproj" in (caught.value.hint or "")
