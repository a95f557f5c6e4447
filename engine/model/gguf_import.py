"""A GGUF model as a Hugging Face folder: dequantized once into the user's data folder, then loaded like any other.

Training needs float weights that autograd and peft understand, so a GGUF model (a ``.gguf`` file, an Ollama or
LM Studio model: :mod:`engine.model.local_sources`) is read by transformers' GGUF loader, dequantized to the run's
compute dtype, and saved with its tokenizer and chat template as a plain folder under
``<data folder>/converted-models/``. Every later run, chat and export of that model reads the folder; QLoRA
quantizes it again, to NF4, as it would a hub model. transformers refuses to save a model loaded from GGUF while
its config carries the GGUF quantization settings, so they are cleared first. The folder is written beside its
final place and renamed into it, so a conversion that fails or is stopped leaves nothing a later run would trust.

One folder per file and dtype: the dequantized weights differ by dtype, and a run in float32 (on the CPU) should
not train on bfloat16-rounded ones. The folder's ``tunedeck-source.json`` records what it was made from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import data_dir
from engine.errors import ModelLoadError
from engine.events import Event, Notice
from engine.model.local_sources import LocalGguf, find_local_model, transformers_gguf_families

CONVERTED_DIR = "converted-models"
SOURCE_FILE = "tunedeck-source.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

Progress = Callable[[str, float, float | None], None]
"""(what, done, total): e.g. ('dequantizing Q4_1 → float32', 120, 272); total None while the amount is unknown."""


@dataclass(frozen=True)
class Conversion:
    """A GGUF model's converted folder, and what it was made from."""

    model: LocalGguf
    folder: Path
    dtype: str
    reused: bool
    seconds: float = 0.0

    def what(self) -> str:
        """'Q4_1 → float32'."""
        return f"{self.model.header.quantization} → {self.dtype}"

    def message(self, qlora: bool = False) -> str:
        """For the user: what was dequantized from what, and where the folder is."""
        again = "; QLoRA quantizes it again to 4-bit NF4" if qlora else ""
        if self.reused:
            return f"{self.model.name}: GGUF weights dequantized {self.what()} (converted before, {self.folder}){again}"
        return (
            f"{self.model.name}: dequantized {self.what()} ({self.model.header.describe_types()}) in "
            f"{self.seconds:.0f} s into {self.folder}; later runs reuse it{again}"
        )


def converted_root() -> Path:
    return data_dir() / CONVERTED_DIR


def folder_for(model: LocalGguf, dtype: torch.dtype) -> Path:
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", model.label).strip("-.") or "model"
    return converted_root() / f"{label}-{model.identity[:12]}-{DTYPE_NAMES[dtype]}"


def find_converted(model: LocalGguf, dtype: torch.dtype | None = None) -> Path | None:
    """The model's converted folder in ``dtype``; without one (or no dtype given), the most recently made one in
    any dtype (a merge in float32 reads the bfloat16 weights a run trained on exactly); None when there is none."""
    if dtype is not None and (folder_for(model, dtype) / SOURCE_FILE).exists():
        return folder_for(model, dtype)
    made = [folder_for(model, other) for other in DTYPE_NAMES]
    made = [folder for folder in made if (folder / SOURCE_FILE).exists()]
    return max(made, key=lambda folder: (folder / SOURCE_FILE).stat().st_mtime, default=None)


def check_readable(model: LocalGguf) -> None:
    """ModelLoadError naming the families transformers reads when it cannot read this model's."""
    if model.readable:
        return
    raise ModelLoadError(
        f"{model.name} is a {model.header.architecture or 'unnamed'} model: transformers cannot read that family "
        "from GGUF, so TuneDeck cannot train it",
        hint=f"families transformers reads from GGUF: {', '.join(transformers_gguf_families())}; or start from "
        "the model's Hugging Face folder",
    )


def convert(model: LocalGguf, dtype: torch.dtype, report: Progress | None = None) -> Conversion:
    """The model's folder in ``dtype``, converted now unless it was before."""
    existing = find_converted(model, dtype)
    if existing is not None and existing == folder_for(model, dtype):
        return Conversion(model, existing, DTYPE_NAMES[dtype], reused=True)
    check_readable(model)
    report = report or (lambda what, done, total: None)
    started = time.monotonic()
    target = folder_for(model, dtype)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _write_folder(model, dtype, partial, report)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            raise ModelLoadError(f"cannot write the converted model to {target}: {err}") from err
        raise
    report("done", 1, 1)
    return Conversion(model, target, DTYPE_NAMES[dtype], reused=False, seconds=time.monotonic() - started)


def _write_folder(model: LocalGguf, dtype: torch.dtype, folder: Path, report: Progress) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    where, file = str(model.path.parent), model.path.name
    what = f"dequantizing {model.header.quantization} → {DTYPE_NAMES[dtype]}"
    report("reading the GGUF metadata", 0, None)
    _check_complete(model, where, file, dtype)
    report(what, 0, None)
    try:
        with _TensorProgress(what, report):
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                where, gguf_file=file, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
            )
        report("reading the tokenizer and chat template", 0, None)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
    except Exception as err:  # transformers raises ValueError, KeyError, RuntimeError... for files it cannot map
        raise ModelLoadError(
            f"transformers cannot load {model.name} from GGUF: {str(err).splitlines()[0] if str(err) else err!r}",
            hint=f"families transformers reads from GGUF: {', '.join(transformers_gguf_families())}",
        ) from err
    # A model loaded from GGUF carries its quantization settings; transformers will not save it with them.
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    report("writing the converted folder", 0, None)
    folder.mkdir(parents=True)
    loaded.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    source = {
        "name": model.name,
        "file": str(model.path),
        "origin": model.origin,
        "architecture": model.header.architecture,
        "quantization": model.header.quantization,
        "tensor_types": dict(model.header.tensor_types),
        "dtype": DTYPE_NAMES[dtype],
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")


def _check_complete(model: LocalGguf, where: str, file: str, dtype: torch.dtype) -> None:
    """Refuse a file whose tensors are far fewer than the model its metadata describes, before loading it.

    transformers fills metadata a file lacks with the family's defaults and weights it lacks with random values: a
    2,000-weight llama file with no shape metadata became a 7B model, 21 GiB of float32, before anything failed.
    The model is built on the meta device here (no memory) and its size compared with the file's.
    """
    from transformers import AutoConfig

    from engine.model.moe_load import meta_model

    try:
        config = AutoConfig.from_pretrained(where, gguf_file=file)
        expected = sum(param.numel() for param in meta_model(config, dtype).parameters())
    except Exception as err:  # transformers raises ValueError, KeyError... for metadata it cannot map
        raise ModelLoadError(
            f"transformers cannot read the metadata of {model.name}: {str(err).splitlines()[0] if str(err) else err!r}",
            hint=f"families transformers reads from GGUF: {', '.join(transformers_gguf_families())}",
        ) from err
    if expected > 1.1 * model.header.parameters:
        raise ModelLoadError(
            f"{model.name} holds {model.header.parameters:,} weights, but its metadata describes a model of "
            f"{expected:,}: the file lacks part of the model",
            hint="download it again, or convert it again with a current llama.cpp",
        )


class _TensorProgress:
    """Reports transformers' per-tensor dequantization bar while it runs: the loader draws a tqdm bar and takes no
    callback, so a watcher thread reads the bar's count (its public ``n`` and ``total``) every 0.2 s."""

    DESCRIPTION = "GGUF"

    def __init__(self, what: str, report: Progress) -> None:
        self.what, self.report = what, report
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="gguf-progress", daemon=True)

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _watch(self) -> None:
        from tqdm import tqdm

        while not self.stop.wait(0.2):
            for bar in list(getattr(tqdm, "_instances", ())):
                if self.DESCRIPTION in str(getattr(bar, "desc", "")) and bar.total:
                    self.report(self.what, float(bar.n), float(bar.total))


def dtype_for(name: str) -> torch.dtype:
    return {value: key for key, value in DTYPE_NAMES.items()}[name]


def prepare_gguf_model(name: str, dtype: torch.dtype, qlora: bool = False) -> Generator[Event, None, None]:
    """Before a run loads ``name``: when it is a GGUF model, make sure its folder in ``dtype`` exists (converting
    it now if need be) and say what was dequantized from what. Nothing happens for a folder or a hub id."""
    model = find_local_model(name)
    if model is None:
        return
    existing = find_converted(model, dtype)
    if existing is None or existing != folder_for(model, dtype):
        check_readable(model)
        yield Notice(
            f"{model.name}: converting its GGUF weights once ({model.header.quantization} → {DTYPE_NAMES[dtype]}, "
            f"{model.size_bytes / 1e9:.1f} GB file)"
        )
    yield Notice(convert(model, dtype).message(qlora))
