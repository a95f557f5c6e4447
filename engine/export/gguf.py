"""GGUF export: the merged fine-tune as one file for llama.cpp, Ollama and LM Studio, plus an Ollama Modelfile.

The run's adapter is merged into a float32 copy of its base (as for the merged export), then every tensor is
renamed with the ``gguf`` package's name maps, reshaped where the family needs it (see ``gguf_families``) and
written with its quantization: f32/f16/bf16 and the block formats the ``gguf`` package implements (q8_0, q4_0,
q4_1, q5_0, q5_1) are written directly; norms, biases and other 1-D tensors stay float32, as llama.cpp's own
converter keeps them. The k-quants (q4_k_m and friends) come from llama.cpp's own quantizer, through
llama-cpp-python when it is installed: a float16 GGUF is written first and quantized into the target.

The tokenizer, its special tokens and the chat template go into the metadata (``gguf_vocab``), and the folder
gets a Modelfile (``modelfile``) and a README. The written file is read back (``gguf_types``): the README, the
progress report and the file name of a k-quant (or of a file where many tensors fell back to another type) say
which tensor types it holds. Everything is written to a temporary folder that is renamed into place at the end,
so a failed export leaves nothing behind.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import TuneDeckError
from engine.export import gguf_families, gguf_types, gguf_vocab, modelfile
from engine.export.merged import _commit, _prepare_target, _readme, _run_adapter, merged_model

PYTHON_QUANTS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
LLAMA_CPP_QUANTS = ("q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_l", "q3_k_m", "q3_k_s", "q2_k")
GGUF_QUANTS: tuple[str, ...] = PYTHON_QUANTS + LLAMA_CPP_QUANTS

LLAMA_CPP_HINT = (
    "install llama-cpp-python (pip install llama-cpp-python; to build it for any CPU, first set "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF")'
    f", or choose one of {', '.join(PYTHON_QUANTS)}"
)


@dataclass(frozen=True)
class ExportProgress:
    """One step of a long export: ``done`` of ``total`` in ``stage``."""

    stage: str  # "merging", "converting", "quantizing", "checking" or "writing"
    done: int
    total: int
    message: str = ""


ProgressCallback = Callable[[ExportProgress], None]


def supported_gguf_family(model_type: str) -> bool:
    """Whether ``tunedeck export --gguf`` can convert models of this transformers ``model_type``."""
    return model_type in gguf_families.FAMILIES


def normalize_quant(quant: str) -> str:
    name = quant.strip().lower()
    if name not in GGUF_QUANTS:
        raise TuneDeckError(f"unknown GGUF quantization {quant!r}", hint=f"use one of {', '.join(GGUF_QUANTS)}")
    return name


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as err:
        raise TuneDeckError("the k-quants (q4_k_m etc.) need llama.cpp's quantizer", hint=LLAMA_CPP_HINT) from err
    return llama_cpp


# ------------------------------------------------------------------------------------------------- tensors


KEEP_F32 = ("rope_freqs", "rope_factors", "ffn_gate_inp", "attn_sinks")  # small tensors llama.cpp adds in f32


def _tensor_type(quant: str, name: str, shape: tuple[int, ...]) -> Any:
    """The GGML type one tensor is stored as: biases, 1-D tensors and MoE routers stay float32, and rows that do
    not fit the quantization block fall back to float16."""
    import gguf

    if len(shape) < 2 or quant == "f32" or name.endswith(".bias") or any(part in name for part in KEEP_F32):
        return gguf.GGMLQuantizationType.F32
    kind = gguf.GGMLQuantizationType[quant.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return kind


def _encode(array: Any, kind: Any) -> Any:
    import gguf
    import numpy as np

    if kind == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    if kind == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(array, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind)


def _tensors(model: Any, family: gguf_families.Family) -> Iterator[tuple[str, Any]]:
    """(gguf name, float32 array) for every tensor llama.cpp reads, in the model's order."""
    import gguf

    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.arch], int(config.num_hidden_layers))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    yield from gguf_families.extra_tensors(family, config)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        array = tensor.detach().float().cpu().numpy()
        for name, part in gguf_families.transform(family, config, hf_name, array):
            target = gguf_families.gguf_name(name_map, name)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise TuneDeckError(f"GGUF export cannot place the tensor {name!r} of this {family.arch} model")
            if not target.endswith((".weight", ".bias")):  # expert stacks and attention sinks
                target += ".weight"
            yield target, part


def _write_gguf(
    path: Path, model: Any, tokenizer_dir: Path, tokenizer: Any, quant: str, report: ProgressCallback
) -> None:
    """Write ``model`` (float32, merged) with ``tokenizer`` to ``path`` as one GGUF file in ``quant``."""
    import gguf

    config = model.config
    family = gguf_families.family_for(config.model_type)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[family.arch]]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(path.stem)
    writer.add_file_type(_file_type(quant))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_families.add_metadata(writer, family, config)
    gguf_vocab.add_tokenizer(writer, tokenizer, tokenizer_dir, int(config.vocab_size))
    plan = []
    for name, array in _tensors(model, family):
        kind = _tensor_type(quant, name, array.shape)
        raw = kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        shape = gguf.quant_shape_to_byte_shape(array.shape, kind) if raw else array.shape
        writer.add_tensor_info(name, shape, _numpy_dtype(kind), _nbytes(array.shape, kind), raw_dtype=kind)
        plan.append((name, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for done, ((name, kind), (_, array)) in enumerate(zip(plan, _tensors(model, family), strict=True), start=1):
        writer.write_tensor_data(_encode(array, kind))
        report(ExportProgress("converting", done, len(plan), name))
    writer.close()


def _nbytes(shape: tuple[int, ...], kind: Any) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    count = 1
    for dim in shape:
        count *= int(dim)
    return count // block * size


def _numpy_dtype(kind: Any) -> Any:
    import gguf
    import numpy as np

    if kind == gguf.GGMLQuantizationType.F32:
        return np.float32
    if kind == gguf.GGMLQuantizationType.F16:
        return np.float16
    return np.uint8


def _file_type(quant: str) -> int:
    import gguf

    return int(gguf.LlamaFileType.ALL_F32 if quant == "f32" else gguf.LlamaFileType[f"MOSTLY_{quant.upper()}"])


# -------------------------------------------------------------------------------------------------- export

GGUF_README = """# {name}: GGUF ({quant})

The base model `{base}` with a TuneDeck LoRA fine-tune folded into its weights, as one GGUF file
(`{gguf}`, {quant}) with its tokenizer and chat template, for llama.cpp, Ollama and LM Studio.

Tensor types in the file: {types}.{advice}

## Ollama

```sh
ollama create {ollama} -f {folder}/Modelfile
ollama run {ollama}
```

The Modelfile points at `./{gguf}` and sets the chat template and stop tokens.

## llama.cpp

```sh
llama-cli -m {folder}/{gguf} -cnv
llama-server -m {folder}/{gguf} --port 8080
```

## LM Studio

Import `{gguf}` (`lms import {folder}/{gguf}`, or copy it under LM Studio's models folder as
`<publisher>/<model>/{gguf}`), then load it; the chat template comes from the file.

Trained for {steps} steps; final training loss {loss}. {weights}
"""


def model_slug(name: str) -> str:
    """A file and Ollama model name from the run's name: lower case letters, digits, '-', '_' and '.'."""
    text = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()).strip("-.")
    return text or "model"


def _check_family(run_folder: Path, adapter: str) -> None:
    """Refuse an unsupported family before the (slow) merge, when the base model's config can be read."""
    from engine.config import RunConfig

    _run_adapter(run_folder, adapter)
    try:
        from transformers import AutoConfig

        from engine.model.load import resolve_model

        config = RunConfig.load(run_folder / "config.json")
        model_type = AutoConfig.from_pretrained(resolve_model(config.model.name).location).model_type
    except Exception:  # the merge reports an unreadable base with its own clear error
        return
    gguf_families.family_for(model_type)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    found = list(ids) if isinstance(ids, list | tuple) else ([ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in found:
        found.append(tokenizer.eos_token_id)
    return [int(i) for i in found]


def _quantize_with_llama_cpp(source: Path, path: Path, quant: str, report: ProgressCallback) -> None:
    """llama.cpp's own quantizer: ``source`` (a float16 GGUF) -> ``path`` in ``quant``. Its log (a line per tensor,
    and a warning per tensor that falls back to another type) is collected and reported as one line."""
    import ctypes
    import os

    llama_cpp = _llama_cpp()
    report(ExportProgress("quantizing", 0, 1, f"llama.cpp is quantizing to {quant}"))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    params.nthread = max(1, (os.cpu_count() or 1))
    log: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def collect(level: int, text: bytes, user_data: Any) -> None:
        log.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params))
    finally:
        _restore_llama_cpp_log(llama_cpp)
    if status != 0 or not path.exists():
        tail = "".join(log).strip().splitlines()[-1:] or [""]
        raise TuneDeckError(f"llama.cpp could not quantize the model to {quant} (status {status}) {tail[0]}".strip())
    report(ExportProgress("quantizing", 1, 1, gguf_types.fallback_line("".join(log)) or ""))


def _restore_llama_cpp_log(llama_cpp: Any) -> None:
    """llama-cpp-python's own log callback again (it prints errors, or everything when verbose)."""
    import ctypes
    import importlib

    try:
        callback = importlib.import_module("llama_cpp._logger").llama_log_callback
    except (ImportError, AttributeError):  # another llama-cpp-python layout: llama.cpp's default log
        callback = None
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


def _write_model(path: Path, model: Any, tokenizer: Any, quant: str, report: ProgressCallback) -> None:
    with tempfile.TemporaryDirectory(prefix="tunedeck-gguf-") as scratch:
        tokenizer_dir = Path(scratch) / "tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        model.config.to_json_file(tokenizer_dir / "config.json")  # special token ids from the model config
        if quant in LLAMA_CPP_QUANTS:
            source = Path(scratch) / "model-f16.gguf"
            _write_gguf(source, model, tokenizer_dir, tokenizer, "f16", report)
            _quantize_with_llama_cpp(source, path, quant, report)
        else:
            _write_gguf(path, model, tokenizer_dir, tokenizer, quant, report)


def _checked_name(path: Path, quant: str, report: ProgressCallback) -> tuple[Path, gguf_types.TensorTypes]:
    """Read the written file's tensor types back; a k-quant file, or one where much fell back, is renamed to
    say so (``name-q4_k_m.gguf``, ``name-q4_k_m-mostly-q5_0.gguf``)."""
    types = gguf_types.tensor_types(path, quant)
    report(ExportProgress("checking", 1, 1, types.summary()))
    if quant not in LLAMA_CPP_QUANTS and not types.fell_back_much:
        return path, types
    named = path.with_name(f"{path.stem}-{types.file_label()}.gguf")
    path.rename(named)
    return named, types


def export_text_gguf(
    run_folder: str | Path,
    target: str | Path,
    *,
    quant: str = "q8_0",
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
    adapter: str = "best",
) -> Path:
    """Write the run's text model merged with ``adapter`` (best or last) to ``target`` as ``<name>.gguf`` with a
    Modelfile and README; returns ``target`` (a vision-language run: engine.export.to_gguf).

    Raises TuneDeckError for an unknown quantization, a family GGUF export does not support, a k-quant without
    llama-cpp-python, or a target folder that is not empty (unless ``overwrite``).
    """
    run_folder, target = Path(run_folder), Path(target)
    quant = normalize_quant(quant)
    report = on_progress or (lambda _: None)
    if quant in LLAMA_CPP_QUANTS:
        _llama_cpp()
    _check_family(run_folder, adapter)
    if target.exists() and any(target.iterdir()) and not overwrite:
        _prepare_target(target, overwrite)  # raises the usual "not empty" error before the slow merge
    report(ExportProgress("merging", 0, 1, "merging the adapter into the base model"))
    from engine.data.tokenize import ensure_chat_template

    model, tokenizer = merged_model(run_folder, "float32", adapter)
    ensure_chat_template(tokenizer)  # the ChatML fallback the run trained with, when the tokenizer has none
    gguf_families.check_config(gguf_families.family_for(model.config.model_type), model.config)
    report(ExportProgress("merging", 1, 1))
    name = model_slug(run_folder.name)
    tmp = _prepare_target(target, overwrite)
    try:
        tmp.mkdir(parents=True)
        _write_model(tmp / f"{name}.gguf", model, tokenizer, quant, report)
        path, types = _checked_name(tmp / f"{name}.gguf", quant, report)
        report(ExportProgress("writing", 0, 1, "Modelfile and README"))
        fmt = modelfile.chat_format(tokenizer)
        stops = modelfile.stop_tokens(tokenizer, fmt, _eos_ids(model, tokenizer))
        (tmp / "Modelfile").write_text(modelfile.modelfile(path.name, fmt, stops), encoding="utf-8")
        advice = types.suggestion()
        extra = {"types": types.summary(), "advice": f"\n{advice[0].upper()}{advice[1:]}." if advice else ""}
        chosen = _run_adapter(run_folder, adapter)
        readme = _readme(GGUF_README, run_folder, target, chosen, quant=quant, gguf=path.name, ollama=name, **extra)
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        report(ExportProgress("writing", 1, 1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(tmp, target)
