"""GGUF export of an Idefics3 / SmolVLM fine-tune: the language model and llama.cpp's vision projector file read
back with the names, shapes and metadata llama.cpp's clip loader expects, and llama.cpp (through llama-cpp-python)
loads both and encodes a picture into the same image embeddings as the merged model in transformers."""

from __future__ import annotations

import json
import subprocess
import sys
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
slices = []
for i in range(M.mtmd_input_chunks_size(chunks)):
    chunk = M.mtmd_input_chunks_get(chunks, i)
    if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
        count = M.mtmd_input_chunk_get_n_tokens(chunk)
        assert M.mtmd_encode_chunk(ctx, chunk) == 0
        width = llm.n_embd()
        slices.append(np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(count, width)).tolist())
print(json.dumps(slices))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run folder, GGUF folder) of a two-step run of a tiny Idefics3 with SmolVLM's pixel shuffle."""
    folder = tmp_path_factory.mktemp("smolvlm")
    model = build_vision_model(folder / "model", "idefics3", scale_factor=2)
    events = list(run(config(model, colour_rows(folder), folder / "runs", max_steps=2, learning_rate=5e-2)))
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    return Path(finished.run_dir), export_gguf(finished.run_dir, folder / "gguf", quant="f16")


def fields(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(metadata, tensor name -> shape as transformers holds it) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    return meta, {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}


def test_the_language_model_and_its_projector_read_back_as_llama_cpp_expects(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    model, projector = folder / "vision.gguf", folder / "mmproj-vision.gguf"
    assert model.exists() and projector.exists() and "--mmproj mmproj-vision.gguf" in (folder / "README.md").read_text()
    meta, shapes = fields(model)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert shapes["token_embd.weight"][1] == 64 and not any(name.startswith(("v.", "mm.")) for name in shapes)
    meta, shapes = fields(projector)
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == "idefics3" and meta["clip.has_vision_encoder"] is True
    assert meta["clip.vision.projector.scale_factor"] == 2 and meta["clip.vision.projection_dim"] == 64
    assert (meta["clip.vision.image_size"], meta["clip.vision.patch_size"]) == (32, 8)
    assert meta["clip.vision.image_mean"] == [0.5, 0.5, 0.5] and meta["clip.vision.preproc_image_size"] == 64
    assert shapes["v.patch_embd.weight"] == (32, 3, 8, 8) and shapes["v.position_embd.weight"] == (16, 32)
    assert shapes["v.blk.0.attn_q.weight"] == (32, 32) and shapes["v.blk.0.ffn_up.weight"] == (64, 32)
    assert shapes["mm.model.fc.weight"] == (64, 128)  # 32 x 2 x 2 after the pixel shuffle, into the text width
    assert len(shapes) == 22 and "v.post_ln.weight" in shapes


def test_llama_cpp_encodes_a_picture_as_the_merged_model_does(exported: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp", reason="llama-cpp-python without llama.cpp's multimodal library")
    import numpy as np
    import torch
    from PIL import Image
    from vision_models import draw

    from engine.export.merged import merged_model

    run_dir, folder = exported
    picture = draw(tmp_path / "red.png", (220, 20, 20), size=(64, 64))
    args = [sys.executable, "-c", ENCODE, str(folder / "vision.gguf"), str(folder / "mmproj-vision.gguf"), str(picture)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=HANG_S)  # a llama.cpp abort fails the test
    assert done.returncode == 0, done.stderr[-3000:]
    slices = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
    model, processor = merged_model(run_dir, "float32")
    inputs = processor(text=["User:<image>colour?"], images=[[Image.open(picture).convert("RGB")]], return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(
            pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"]
        )
    found = getattr(features, "pooler_output", features)  # a tensor per picture
    expected = (found if isinstance(found, torch.Tensor) else torch.cat(list(found))).reshape(slices.shape).numpy()
    assert slices.shape == (5, 4, 64)  # four 32-pixel tiles of the 64-pixel picture and the whole picture
    np.testing.assert_allclose(slices, expected, atol=2e-3)  # the tower's matrices are float16 in the file


def test_installing_a_picture_model_into_ollama_or_lm_studio_says_why_not(exported: tuple[Path, Path]) -> None:
    from engine.errors import TuneDeckError
    from engine.export.install import read_export

    with pytest.raises(TuneDeckError, match="installs text models only") as caught:
        read_export(exported[1])
    assert "--mmproj" in (caught.value.hint or "")
