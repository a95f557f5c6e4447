"""The Hugging Face hub, reached only when the user asks: what is on this computer is read from the cache on disk.

Choosing a model or a dataset sends nothing: a hub model's ``config.json`` and tokenizer are looked up in the cache
(``try_to_load_from_cache``, a file lookup) and loaded from that folder, because huggingface_hub's own calls,
``local_files_only`` included, send a request on their first use (its agent registry) unless the hub is switched
off. A download happens on a button the user pressed, and offline mode (``HF_HUB_OFFLINE``, read by
:func:`engine.model.load.hub_offline` as everywhere in the engine) turns it into a lookup in the cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.errors import ModelLoadError

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
"""What training needs from a hub repository: configs, safetensors weights, tokenizer files (never pickles)."""

FETCH_HINT = "fetch it from the Hugging Face hub with the Dataset page's button (a few MB), or choose another model"

TOKENIZER_LOCK = threading.Lock()
"""Two first imports of transformers' lazy AutoTokenizer in two threads fail ("cannot import name
'AutoTokenizer'"), e.g. the demo data loading for the demo model while the user opens a file: one at a time."""

Progress = Callable[[str, float, float | None], None]
"""(what, done, total) — e.g. ("Fetching 9 files", 3, 9) or ("model.safetensors", 1.2e9, 3.4e9)."""


def hub_error(name: str, err: Exception) -> ModelLoadError:
    """What went wrong reading ``name`` from the hub, in words: offline and not cached, or the hub's own error."""
    from engine.model.load import hub_offline

    if hub_offline():
        return ModelLoadError(
            f"'{name}' is not in the local Hugging Face cache and offline mode is on",
            hint="download it once while online, or unset HF_HUB_OFFLINE",
        )
    return ModelLoadError(
        f"cannot read '{name}' from the hub: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
        hint="check the model id and your network; gated models need a Hugging Face token",
    )


def model_config_path(name: str) -> Path | str:
    """A local config.json for the model, or a built-in shape name the planner knows (gallery models included).

    A hub id that is not cached is fetched alone (the user typed it and asked); offline, the error says so."""
    from engine.hardware.gallery import find_entry
    from engine.hardware.shapes import builtin_shape_names
    from engine.model.load import hub_offline, resolve_model

    entry = find_entry(name)
    if entry is not None and not entry.is_demo and not Path(name).expanduser().exists():
        return entry.key
    source = resolve_model(name)
    if source.is_local:
        return Path(source.location)
    if name.lower().rsplit("/", 1)[-1] in builtin_shape_names():
        return name
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")  # on disk only: a fetched model is never looked up again
    if isinstance(cached, str):
        return Path(cached)
    try:
        return Path(hf_hub_download(name, "config.json", local_files_only=hub_offline()))
    except Exception as err:
        raise hub_error(name, err) from err


def tokenizer_on_disk(model_name: str, use_hub: bool = False) -> Any:
    """``model_name``'s tokenizer from its folder or the Hugging Face cache; from the hub only when ``use_hub`` (the
    user asked). Nothing is sent unasked: a hub id is never looked up, not even for updates."""
    from engine.model import load

    with TOKENIZER_LOCK:
        if load.resolve_model(model_name).is_local or (use_hub and not load.hub_offline()):
            return load.load_tokenizer(ModelConfig(name=model_name))
        return _cached_tokenizer(model_name)


def _cached_tokenizer(model_name: str) -> Any:
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoTokenizer

    cached = try_to_load_from_cache(model_name, "tokenizer.json")
    if not isinstance(cached, str):
        raise ModelLoadError("it is not on this computer", hint=FETCH_HINT)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(cached).parent))
    except Exception as err:  # a cache without the other tokenizer files
        raise ModelLoadError(f"it is not whole on this computer: {err}", hint=FETCH_HINT) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def progress_bar_class(report: Progress) -> type:
    """A tqdm class that forwards every update to ``report`` instead of drawing, for huggingface_hub."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):  # type: ignore[misc]  # tqdm ships no type information
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = False
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 (closed with the bar)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown: bool | None = super().update(n)
            report(str(self.desc or "downloading"), float(self.n), float(self.total) if self.total else None)
            return shown

        def close(self) -> None:
            super().close()
            self.fp.close()

    return Reporting


def download_model(name: str, report: Progress) -> Path:
    """Fetch a hub model's training files into the Hugging Face cache (or find them there when offline)."""
    from huggingface_hub import snapshot_download

    from engine.model.load import hub_offline

    try:
        folder = snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=hub_offline(),
                                   tqdm_class=progress_bar_class(report))  # fmt: skip
    except Exception as err:
        raise hub_error(name, err) from err
    return Path(str(folder))
