"""Finding GGUF models on this computer without a model: Ollama's store layouts and names, LM Studio's folders, the
names --model takes (and the folders and hub ids it must leave alone), the header reader against the gguf package's
own, and run folder names that every file system accepts. Tiny GGUF files are written in milliseconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ollama_store import add_to_ollama_store

from engine.config import RunConfig
from engine.errors import ModelLoadError
from engine.model.local_sources import (
    find_local_model,
    is_local_gguf_name,
    list_lmstudio,
    list_ollama,
    read_header,
    transformers_gguf_families,
    transformers_name,
    transformers_reads,
)


def tiny_gguf(path: Path, architecture: str = "llama", quantized: bool = True) -> Path:
    """A GGUF file with a name, a file type, a string array (as tokenizers have) and a few tensors."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("Tiny Test Model")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    writer.add_token_list(["<s>", "</s>", "hello", "world"])
    writer.add_chat_template("{{ messages }}")
    weight = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    if quantized:
        packed = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor("blk.0.attn_q.weight", packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor("blk.0.attn_q.weight", weight)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    import gguf

    path = tiny_gguf(tmp_path / "tiny.gguf")
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert header.architecture == "llama" and header.title == "Tiny Test Model"
    assert header.file_type == "Q8_0" and header.quantization == "Q8_0" and header.has_chat_template
    assert header.tensor_types == (("F32", 2), ("Q8_0", 1))
    assert header.parameters == sum(int(t.n_elements) for t in reader.tensors) == 64 * 32 + 64
    unquantized = read_header(tiny_gguf(tmp_path / "f32.gguf", quantized=False))
    assert unquantized.quantization == "F32"
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelLoadError, match="cannot read the GGUF header"):
        read_header(tmp_path / "broken.gguf")


def test_ollama_names_follow_ollamas_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "models"
    gguf_file = tiny_gguf(tmp_path / "tiny.gguf")
    add_to_ollama_store(store, gguf_file, "tiny", "latest")
    user = store / "manifests" / "registry.ollama.ai" / "someone" / "tuned" / "v2"
    user.parent.mkdir(parents=True)
    user.write_text((store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest").read_text())
    hub = store / "manifests" / "hf.co" / "org" / "Repo-GGUF" / "Q8_0"
    hub.parent.mkdir(parents=True)
    hub.write_text(user.read_text())
    no_weights = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    no_weights.parent.mkdir(parents=True)
    no_weights.write_text('{"layers": []}')
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    names = [model.name for model in list_ollama()]
    assert names == ["ollama:hf.co/org/Repo-GGUF:Q8_0", "ollama:tiny:latest", "ollama:someone/tuned:v2"]
    assert find_local_model("ollama:tiny") == find_local_model("tiny:latest") == list_ollama()[1]
    assert find_local_model("someone/tuned:v2") is not None
    with pytest.raises(ModelLoadError, match="no GGUF weights") as missing:
        find_local_model("ollama:broken")
    assert "ollama pull broken:latest" in str(missing.value.hint)


def test_lm_studio_lists_each_quantization_and_asks_which_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    repo = tmp_path / ".cache" / "lm-studio" / "models" / "someone" / "Tiny-GGUF"  # the older folder
    tiny_gguf(repo / "tiny-Q8_0.gguf")
    tiny_gguf(repo / "tiny-F32.gguf", quantized=False)
    tiny_gguf(repo / "mmproj-tiny-f16.gguf", architecture="clip")
    tiny_gguf(repo / "big-00002-of-00002.gguf")
    listed = list_lmstudio()
    assert [(m.name.rsplit("/", 1)[-1], m.header.quantization) for m in listed] == [
        ("tiny-F32.gguf", "F32"),
        ("tiny-Q8_0.gguf", "Q8_0"),
    ]
    assert find_local_model("lmstudio:someone/Tiny-GGUF/tiny-Q8_0.gguf") == listed[1]
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files") as which:
        find_local_model("lmstudio:someone/Tiny-GGUF")
    assert "lmstudio:someone/Tiny-GGUF/tiny-F32.gguf" in str(which.value.hint)


@pytest.mark.parametrize(
    ("name", "local"),
    [
        ("demo", False),
        ("Qwen/Qwen3-0.6B", False),
        ("gpt2", False),
        ("ollama:llama3.2", True),
        ("llama3.2:1b", True),
        ("lmstudio:someone/Repo", True),
        ("~/models/x.gguf", True),
        ("C:\\models\\folder", False),
    ],
)
def test_which_names_are_gguf_models(name: str, local: bool) -> None:
    assert is_local_gguf_name(name) is local


def test_folders_and_unsuffixed_gguf_files(tmp_path: Path) -> None:
    folder = tmp_path / "with:colon"
    folder.mkdir()
    assert not is_local_gguf_name(str(folder))  # a model folder is never taken for an Ollama name
    blob = tiny_gguf(tmp_path / "sha256-abc")  # an Ollama blob passed by its path
    found = find_local_model(str(blob))
    assert found is not None and found.origin == "file" and found.header.quantization == "Q8_0"


def test_the_families_are_the_causal_language_models_transformers_reads_from_gguf() -> None:
    """Against transformers' documented GGUF support (written out here, not read from its lists): the decoder
    families load; the encoder-decoder ones (T5), vision encoders (CLIP) and the file's non-model sections do not."""
    families = set(transformers_gguf_families())
    documented_causal = {"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3",
                         "falcon", "gpt2", "stablelm", "starcoder2", "bloom", "mamba", "nemotron"}  # fmt: skip
    assert documented_causal <= families, documented_causal - families
    assert not families & {"t5", "umt5", "clip", "tokenizer", "general", "bert"}
    assert transformers_name("qwen3moe") == "qwen3_moe" and transformers_name("gpt-oss") == "gpt_oss"
    assert transformers_reads("qwen2moe") and transformers_reads("llama") and not transformers_reads("clip")


def test_a_run_of_an_ollama_model_gets_a_folder_name_every_file_system_takes(tmp_path: Path) -> None:
    from engine.run.folder import new_run_dir

    config = RunConfig.from_dict(
        {"model": {"name": "ollama:smollm2:135m"}, "data": {"path": "chats.jsonl"}, "output": {"dir": str(tmp_path)}}
    )
    name = new_run_dir(config).name
    assert name.endswith("-ollama-smollm2-135m-chats") and not set(name) & set('<>:"/\\|?*')


GUARDED_CONVERSION = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # should the check fail, this child runs out, not the host
import torch
from engine.errors import ModelLoadError
from engine.model.gguf_import import convert
from engine.model.local_sources import find_local_model
try:
    convert(find_local_model(sys.argv[1]), torch.float32)
except ModelLoadError as err:
    print(err)
"""


def test_a_file_lacking_most_of_its_model_is_refused_before_loading(tmp_path: Path) -> None:
    """transformers would fill the missing shape metadata with Llama's defaults: a 7B model, 26 GB of float32."""
    import os
    import re
    import subprocess
    import sys

    gguf_file = tiny_gguf(tmp_path / "half-a-model.gguf")
    home = tmp_path / "home"
    env = {**os.environ, "TUNEDECK_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-c", GUARDED_CONVERSION, str(gguf_file)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"holds 2,112 weights, but its metadata describes a model of [\d,]+", done.stdout), done.stdout
    assert not list(home.glob("converted-models/*"))
