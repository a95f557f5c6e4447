"""``tunedeck models``: the GGUF models already on this computer (Ollama's store, LM Studio's folder) that a run
can start from, with the name ``--model`` takes, their size and quantization, and whether transformers reads
their family; ``--convert NAME`` converts one now, with progress, instead of at the start of its first run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from engine.errors import TuneDeckError

if TYPE_CHECKING:
    from engine.model.local_sources import LocalGguf


def models_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tunedeck models",
        description="List the GGUF models in Ollama's store (OLLAMA_MODELS, else ~/.ollama/models) and LM Studio's "
        "models folder (~/.lmstudio/models, ~/.cache/lm-studio/models). Train one with "
        "`tunedeck train --model NAME`; a .gguf file's path works too.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    parser.add_argument(
        "--convert",
        metavar="NAME",
        help="convert this GGUF model (a name from the list, or a .gguf path) into its cached Hugging Face folder now",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the dtype to dequantize to with --convert (auto: the one a run on this computer computes in)",
    )
    args = parser.parse_args(argv)
    try:
        return _convert(args.convert, args.dtype) if args.convert else _list(args.json)
    except TuneDeckError as err:
        print(f"tunedeck models: error: {err}", file=sys.stderr)
        return 1


def _list(as_json: bool) -> int:
    from engine.model.local_sources import list_local_models, ollama_models_dir

    models = list_local_models()
    for model in models:
        if as_json:
            print(json.dumps(_row(model)))
        else:
            verdict = "" if model.readable else f"  (transformers cannot read {model.header.architecture} from GGUF)"
            print(
                f"{model.name}\n    {model.size_bytes / 1e9:.2f} GB, {model.header.quantization}, "
                f"{model.header.architecture}, {model.header.parameters / 1e9:.2f}B parameters{verdict}"
            )
    if not models and not as_json:
        print(f"no GGUF models found in Ollama's store ({ollama_models_dir()}) or LM Studio's models folder")
    return 0


def _row(model: LocalGguf) -> dict[str, object]:
    return {
        "name": model.name,
        "origin": model.origin,
        "path": str(model.path),
        "size_bytes": model.size_bytes,
        "quantization": model.header.quantization,
        "architecture": model.header.architecture,
        "parameters": model.header.parameters,
        "readable": model.readable,
    }


def _convert(name: str, dtype_name: str) -> int:
    from tqdm import tqdm

    from engine.model.gguf_import import convert, dtype_for
    from engine.model.load import pick_device, pick_dtype
    from engine.model.local_sources import find_local_model

    model = find_local_model(name) or find_local_model(f"ollama:{name}")
    if model is None:
        raise TuneDeckError(f"{name} is not a GGUF model", hint="`tunedeck models` lists the ones on this computer")
    dtype = pick_dtype("auto", pick_device("auto")) if dtype_name == "auto" else dtype_for(dtype_name)
    stage = {"what": ""}

    def report(what: str, done: float, total: float | None) -> None:
        if what != stage["what"] and what != "done":
            stage["what"] = what
            tqdm.write(f"{model.name}: {what}", file=sys.stderr)

    conversion = convert(model, dtype, report)
    print(conversion.message())
    return 0
