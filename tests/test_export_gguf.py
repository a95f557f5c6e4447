"""GGUF export: files llama.cpp itself loads, with the logits of the merged model.

Each family gets a run folder whose adapter is a random (non-zero) LoRA over all linear layers, so the merge
changes the model measurably. The exported file is loaded with llama-cpp-python (llama.cpp's own loader and
kernels) and its next-token logits are compared with transformers running the merged float32 model:
f16 within 2% of the largest logit, q8_0 with the same argmax on at least 95% of positions (90% for the
six-layer Gemma3 model, whose scaled embeddings make q8_0 noisier on random weights; llama.cpp also keeps its
KV cache in f16, so even f32 files differ from transformers by ~0.1%).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hang import HANG_S
from helpers import build_model, build_tokenizer

from engine.config import RunConfig, demo_model_dir
from engine.errors import TuneDeckError
from engine.export import GGUF_QUANTS, ExportProgress, export_gguf, merged_model, supported_gguf_family

F16_TOLERANCE = 0.02  # of the largest |logit|: f16 weights and llama.cpp's f16 activations
Q8_ARGMAX_AGREEMENT = 0.95
Q8_ARGMAX_AGREEMENT_GEMMA3 = 0.90
TOKENS = 100
NO_LLAMA_CPP = "llama-cpp-python is not installed (the gguf-check extra: pip install -e '.[gguf-check]')"
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason=NO_LLAMA_CPP)
"""On every test that loads an export in llama.cpp: a mark, so the skip comes before the fixtures build the runs."""

PHI3 = {"pad_token_id": 0, "bos_token_id": None, "eos_token_id": 2}
FAMILIES = {  # name -> overrides for a tiny model of that family (the name is its model_type, before any "-")
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "phi3": PHI3,
    "phi3-longrope": {  # Phi-3-128k-style: per-frequency factors past the original context, scaled attention
        **PHI3,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": [1.0, 1.4, 1.9, 2.3, 2.7, 3.1, 3.6, 4.0],
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.25, 1.35, 1.4, 1.5],
            "original_max_position_embeddings": 64,
        },
        "original_max_position_embeddings": 64,
    },
    "mistral": {"head_dim": 16},
    "llama-rope3": {  # Llama-3.1-style rope scaling: llama.cpp reads the per-frequency factors from rope_freqs
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "gemma3_text": {  # six layers: five sliding-window layers (window 32) and one global one
        "num_hidden_layers": 6,
        "sliding_window": 32,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": 2,
    },
    "qwen3_moe": {
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "gpt_oss": {  # alternating sliding-window (32) and full layers, attention sinks, yarn rope, biased experts
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 32,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": 2,
    },
    "olmoe": {
        "num_key_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": 2,
    },
}


def make_run(model_dir: Path, root: Path) -> Path:
    """A finished-looking run folder: config.json and a random LoRA adapter (with the tokenizer) of ``model_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    run = root / "runs" / "tiny-run"
    (run / "adapter").mkdir(parents=True)
    config = RunConfig.from_dict({"model": {"name": str(model_dir)}, "data": {"path": str(root / "data.jsonl")}})
    config.save(run / "config.json")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    model.save_pretrained(run / "adapter")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(run / "adapter")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 2.5}) + "\n")
    return run


def tiny_family_model(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir()
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(folder, vocab, name.split("-")[0], **FAMILIES[name])
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-runs")
    found = {"demo": make_run(demo_model_dir(), root / "demo")}
    for name in FAMILIES:
        found[name] = make_run(tiny_family_model(root, name), root / f"run-{name}")
    return found


def token_ids(vocab_size: int) -> list[int]:
    return [int(i) for i in torch.randint(3, vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(7))]


def transformers_logits(run: Path, ids: list[int]) -> np.ndarray:
    model, _ = merged_model(run, "float32")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


LOGITS_SCRIPT = """
import json, sys
import llama_cpp, numpy as np
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = llama_cpp.Llama(model_path=path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, seed=0)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
llm.close()
"""
TOKENIZE_SCRIPT = """
import json, sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=True) for t in json.loads(sys.argv[2])]))
llm.close()
"""


def in_llama_cpp(script: str, *args: str) -> str:
    """Run ``script`` with llama-cpp-python in a child process: a llama.cpp abort fails the test, not the suite."""
    pytest.importorskip("llama_cpp", reason=NO_LLAMA_CPP)
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, f"llama.cpp failed ({result.returncode}): {result.stderr[-2000:]}"
    return result.stdout


def llama_cpp_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    out = gguf.with_suffix(".logits.npy")
    in_llama_cpp(LOGITS_SCRIPT, str(gguf), json.dumps(ids), str(out))
    return np.load(out)


def export(run: Path, target: Path, quant: str, name: str = "tiny-run.gguf") -> Path:
    stages: list[ExportProgress] = []
    folder = export_gguf(run, target, quant=quant, on_progress=stages.append)
    assert stages[0].stage == "merging" and stages[-1] == ExportProgress("writing", 1, 1)
    assert any(s.stage == "converting" and s.done == s.total for s in stages)
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["Modelfile", "README.md", name]
    assert (folder / "Modelfile").read_text().startswith(f"FROM ./{name}\n")
    return folder / name


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("family", ["demo", *FAMILIES])
def test_llama_cpp_loads_the_export_with_the_merged_logits(runs: dict[str, Path], tmp_path: Path, family: str) -> None:
    run = runs[family]
    base_config = json.loads((Path(RunConfig.load(run / "config.json").model.name) / "config.json").read_text())
    vocab = base_config["vocab_size"]
    ids = token_ids(min(vocab, 280))
    reference = transformers_logits(run, ids)
    f16 = llama_cpp_logits(export(run, tmp_path / "f16", "f16"), ids)
    assert f16.shape == reference.shape
    error = np.abs(f16 - reference).max() / np.abs(reference).max()
    assert error <= F16_TOLERANCE, f"{family}: f16 logits differ by {error:.4f} of the largest logit"
    q8 = llama_cpp_logits(export(run, tmp_path / "q8", "q8_0"), ids)
    agreement = float((q8.argmax(-1) == reference.argmax(-1)).mean())
    threshold = Q8_ARGMAX_AGREEMENT_GEMMA3 if family == "gemma3_text" else Q8_ARGMAX_AGREEMENT
    assert agreement >= threshold, f"{family}: q8_0 argmax agrees on {agreement:.0%} of positions"


@needs_llama_cpp
@pytest.mark.slow
def test_k_quants_come_from_llama_cpp(runs: dict[str, Path], tmp_path: Path) -> None:
    """q4_k_m: a float16 file quantized by llama.cpp's own quantizer, which loads and still mostly agrees."""
    import gguf

    run = runs["demo"]  # hidden size 128: too narrow for k-quant blocks of 256, so llama.cpp falls back
    path = export(run, tmp_path / "q4", "q4_k_m", name="tiny-run-q4_k_m-mostly-q5_0.gguf")
    reader = gguf.GGUFReader(path)
    file_type = reader.fields["general.file_type"].contents()
    assert file_type == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds & {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q8_0"} and "F16" not in kinds
    assert "tokenizer.chat_template" in reader.fields
    ids = token_ids(280)
    agreement = float((llama_cpp_logits(path, ids).argmax(-1) == transformers_logits(run, ids).argmax(-1)).mean())
    assert agreement >= 0.8


def test_families_and_quants_on_offer() -> None:
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "olmoe", "gpt_oss"):
        assert supported_gguf_family(model_type)
    assert not supported_gguf_family("gpt2")
    assert {"f16", "bf16", "q8_0", "q4_k_m"} <= set(GGUF_QUANTS)


def fake_run(root: Path, model_type: str) -> Path:
    """A run folder whose base model is only a config: enough for the checks that come before the merge."""
    base = root / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model_type": model_type}))
    run = root / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    RunConfig.from_dict({"model": {"name": str(base)}, "data": {"path": "x.jsonl"}}).save(run / "config.json")
    return run


def test_unsupported_family_and_quant_are_refused_before_any_work(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "gpt2")
    with pytest.raises(TuneDeckError, match="does not support the 'gpt2' model family"):
        export_gguf(run, tmp_path / "out")
    with pytest.raises(TuneDeckError, match="unknown GGUF quantization 'q9_9'"):
        export_gguf(run, tmp_path / "out", quant="q9_9")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "run"]


def test_k_quants_without_llama_cpp_say_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(TuneDeckError, match=r"llama\.cpp's quantizer") as err:
        export_gguf(fake_run(tmp_path, "llama"), tmp_path / "out", quant="q4_k_m")
    assert "pip install llama-cpp-python" in str(err.value)


def test_failed_export_leaves_nothing_behind(runs: dict[str, Path], tmp_path: Path) -> None:
    def fail_midway(progress: ExportProgress) -> None:
        if progress.stage == "converting" and progress.done == 3:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        export_gguf(runs["qwen2"], tmp_path / "out", on_progress=fail_midway)
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_folder_in_use(runs: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(TuneDeckError, match="not empty"):
        export_gguf(runs["qwen2"], target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    export_gguf(runs["qwen2"], target, quant="f16", overwrite=True)
    assert (target / "tiny-run.gguf").exists() and not (target / "keep.txt").exists()


def test_cli_writes_gguf_modelfile_and_readme(runs: dict[str, Path], tmp_path: Path, capsys) -> None:
    from engine.cli.runs import export_main

    assert export_main([str(runs["qwen3"]), "--to", str(tmp_path / "out"), "--gguf"]) == 0
    out = capsys.readouterr()
    assert "GGUF model (q8_0) and Modelfile written to" in out.out and "converting" in out.err
    readme = (tmp_path / "out" / "README.md").read_text()
    assert f"ollama create tiny-run -f {(tmp_path / 'out').resolve().as_posix()}/Modelfile" in readme
    assert "ollama run tiny-run" in readme and "llama-cli -m" in readme and "LM Studio" in readme
    modelfile = (tmp_path / "out" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./tiny-run.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert export_main([str(runs["qwen3"]), "--to", str(tmp_path / "bad"), "--gguf", "q9_9"]) == 1
    err = capsys.readouterr().err
    assert "tunedeck export: error: unknown GGUF quantization 'q9_9'" in err and "Traceback" not in err


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEXTS = [
    "Don't STOP: it's HelloWorld's 12345 path/to\nfile",
    "hello there, how are you today?",
    "convert 12 march 2021 to 2021-03-12\n\nok",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  spaces   and\ttabs ümlaut 🙂 x",
]


def build_styled_tokenizer(folder: Path, style: str) -> None:
    """A tiny tokenizer in the style of Llama-3 or gpt-oss (regex split + byte-level BPE) or Llama-2 (SentencePiece
    BPE with byte fallback)."""
    from helpers import CORPUS
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if style in ("llama3", "o200k"):
        tokenizer = Tokenizer(models.BPE())
        regex = LLAMA3_SPLIT if style == "llama3" else O200K_SPLIT
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        specials = ["<unk>", *specials, *(f"<0x{i:02X}>" for i in range(256))]
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if style == "spm":  # byte tokens are ordinary vocabulary in SentencePiece models, not added tokens
        fast = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(_unmark_bytes(tokenizer.to_str())),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token="<unk>",
        )
    fast.save_pretrained(folder)


def _unmark_bytes(tokenizer_json: str) -> str:
    data = json.loads(tokenizer_json)
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    return json.dumps(data)


@pytest.fixture(scope="module")
def styled_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("styled")
    found = {}
    for style in ("llama3", "o200k", "spm"):
        folder = root / style
        folder.mkdir()
        build_styled_tokenizer(folder, style)
        vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
        build_model(folder, vocab, "llama")
        found[style] = make_run(folder, root / f"run-{style}")
    return found


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize(
    ("style", "kind"),
    [
        ("demo", "gpt2/starcoder"),
        ("qwen2", "gpt2/qwen2"),
        ("llama3", "gpt2/llama-bpe"),
        ("o200k", "gpt2/gpt-4o"),
        ("spm", "llama/default"),
    ],
)
def test_llama_cpp_tokenizes_like_the_tokenizer(
    runs: dict[str, Path], styled_runs: dict[str, Path], tmp_path: Path, style: str, kind: str
) -> None:
    """The vocabulary, merges, pre-tokenizer and special tokens in the file make llama.cpp split text the same way."""
    import gguf
    from transformers import AutoTokenizer

    run = {**runs, **styled_runs}[style]
    path = export(run, tmp_path / "f16", "f16")
    fields = gguf.GGUFReader(path).fields
    assert f"{fields['tokenizer.ggml.model'].contents()}/{fields['tokenizer.ggml.pre'].contents()}" == kind
    tokenizer = AutoTokenizer.from_pretrained(run / "adapter")
    tokenized = json.loads(in_llama_cpp(TOKENIZE_SCRIPT, str(path), json.dumps(TEXTS)))
    for text, ids in zip(TEXTS, tokenized, strict=True):
        assert ids == tokenizer.encode(text, add_special_tokens=False), text
    ids = token_ids(280)
    reference = transformers_logits(run, ids)
    assert np.abs(llama_cpp_logits(path, ids) - reference).max() <= F16_TOLERANCE * np.abs(reference).max()


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize(
    ("quant", "tolerance", "agreement"),
    [("f32", 0.005, 1.0), ("bf16", 0.03, 0.95), ("q5_1", None, 0.9), ("q5_0", None, 0.9), ("q4_1", None, 0.85),
     ("q4_0", None, 0.85)],
)  # fmt: skip
def test_every_directly_written_quant_loads(
    runs: dict[str, Path], tmp_path: Path, quant: str, tolerance: float | None, agreement: float
) -> None:
    """The quantizations written without llama.cpp: llama.cpp reads them, and they stay close to the model."""
    import gguf

    run = runs["demo"]
    path = export(run, tmp_path / quant, quant)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert quant.upper() in kinds and kinds <= {quant.upper(), "F32"}
    ids = token_ids(280)
    reference, logits = transformers_logits(run, ids), llama_cpp_logits(path, ids)
    if tolerance is not None:
        assert np.abs(logits - reference).max() <= tolerance * np.abs(reference).max()
    assert float((logits.argmax(-1) == reference.argmax(-1)).mean()) >= agreement


# ------------------------------------------------------------------------------------------- honest exports


def counted_types(path: Path) -> str:
    """The file's tensor types counted here, independently of the export, most common first."""
    import collections

    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{count} {kind}" for kind, count in counts.most_common())


def shaped_run(root: Path, **shape: object) -> Path:
    folder = root / "model"
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(folder, vocab, "llama", **shape)
    return make_run(folder, root)


def test_rows_that_do_not_fit_the_blocks_are_counted_named_and_a_type_suggested(tmp_path: Path) -> None:
    """q8_0 stores rows in blocks of 32: a model 48 wide keeps most tensors in f16, and the export says so."""
    from engine.export.gguf_types import tensor_types

    run = shaped_run(tmp_path, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    stages: list[ExportProgress] = []
    folder = export_gguf(run, tmp_path / "out", quant="q8_0", on_progress=stages.append)
    path = folder / "tiny-run-q8_0-mostly-f16.gguf"
    assert path.exists() and (folder / "Modelfile").read_text().startswith(f"FROM ./{path.name}\n")
    types = tensor_types(path)
    assert (types.requested, types.quantized, types.fallback) == ("q8_0", 16, 14)  # ffn_down (128 wide) fits
    summary = f"q8_0 requested: {counted_types(path)} (fallback: 48 columns are not a multiple of 32)"
    assert types.summary() == summary
    assert ExportProgress("checking", 1, 1, summary) in stages
    readme = (folder / "README.md").read_text()
    assert f"Tensor types in the file: {summary}." in readme
    assert "14 of 16 quantized tensors fell back from q8_0: export f16 for one type." in readme
    assert f"llama-cli -m {folder.resolve().as_posix()}/{path.name}" in readme


def test_a_file_with_what_was_asked_for_says_only_that(runs: dict[str, Path], tmp_path: Path) -> None:
    from engine.export.gguf_types import tensor_types

    path = export(runs["qwen2"], tmp_path / "q8", "q8_0")
    types = tensor_types(path)
    assert types.fallback == 0 and types.suggestion() is None and types.file_label() == "q8_0"
    assert types.summary() == f"q8_0 requested: {counted_types(path)}"
    assert "fell back" not in (path.parent / "README.md").read_text()


LLAMA_CPP_LOG = (  # as llama.cpp's log callback delivers it: in pieces, the arrow on a piece of its own
    "llama_model_quantize_impl: model size = 16.01 MiB\n"
    "warning: blk.0.attn_k.weight                  - ncols    576 not divisible by 256 (required for type    q4_K) "
    "\n-> falling back to    q5_0\n"
    "warning: blk.1.attn_v.weight                  - ncols    576 not divisible by 256 (required for type    q6_K) "
    "\n-> falling back to    q8_0\n"
    "warning: blk.1.ffn_up.weight                  - ncols    960 not divisible by 256 (required for type    q4_K) "
    "\n-> falling back to    q5_0\n"
    "llama_model_quantize_impl: WARNING: 3 of 20 tensor(s) required fallback quantization\n"
)


def test_llama_cpps_warnings_become_one_line() -> None:
    from engine.export.gguf_types import fallback_line

    assert fallback_line(LLAMA_CPP_LOG) == (
        "llama.cpp fell back on 3 tensors (576, 960 columns not divisible by 256): q4_K -> q5_0 (2), q6_K -> q8_0 (1)"
    )
    assert fallback_line("llama_model_quantize_impl: model size = 16.01 MiB\n") is None


@needs_llama_cpp
@pytest.mark.slow
def test_k_quant_fallback_is_stated_in_one_line_and_in_the_name(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2-135M's shape (576 wide, MLP 1536): q4_k_m becomes mostly q5_0, and every place says so."""
    from engine.export.gguf_types import tensor_types

    run = shaped_run(
        tmp_path, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        tie_word_embeddings=True,
    )  # fmt: skip
    capfd.readouterr()
    stages: list[ExportProgress] = []
    folder = export_gguf(run, tmp_path / "out", quant="q4_k_m", on_progress=stages.append)
    printed = capfd.readouterr()
    assert "falling back" not in printed.out + printed.err, "llama.cpp's per-tensor warnings are not printed"
    lines = [s.message for s in stages if "fell back" in s.message]
    assert lines == ["llama.cpp fell back on 12 tensors (576 columns not divisible by 256): q4_K -> q5_0 (11), "
                     "q6_K -> q8_0 (1)"]  # fmt: skip
    path = folder / "tiny-run-q4_k_m-mostly-q5_0.gguf"
    summary = f"q4_k_m requested: {counted_types(path)} (fallback: 576 columns are not a multiple of 256)"
    assert tensor_types(path).summary() == summary and summary.startswith("q4_k_m requested: 11 Q5_0, ")
    readme = (folder / "README.md").read_text()
    assert f"Tensor types in the file: {summary}." in readme and "export q5_0 (or q8_0" in readme


@needs_llama_cpp
@pytest.mark.slow
def test_a_k_quant_without_fallback_is_named_for_its_type(tmp_path: Path) -> None:
    from engine.export.gguf_types import tensor_types

    run = shaped_run(tmp_path, hidden_size=256, intermediate_size=512)
    path = export(run, tmp_path / "out", "q4_k_m", name="tiny-run-q4_k_m.gguf")
    types = tensor_types(path)
    assert types.fallback == 0 and types.suggestion() is None
    assert {kind for kind, _ in types.counts} <= {"Q4_K", "Q6_K", "F32"}
    assert "(fallback" not in (path.parent / "README.md").read_text()
