"""The Hugging Face hub, reached only when the user asks: what is on this computer is read from the cache on disk.

Choosing a model or a dataset sends nothing: a hub model's ``config.json`` and tokenizer are looked up in the cache
(``try_to_load_from_cache``, a file lookup) and loaded from that folder, because huggingface_hub's own calls,
``local_files_only`` included, send a request on their first use (its agent registry) unless the hub is switched
off. A download happens on a button the user pressed, and offline mode (``HF_HUB_OFFLINE``, read by
:func:`engine.model.load.hub_offline` as everywhere in the engine) turns it into a lookup in the cache. Before a
download one connection checks that the hub can be reached, so that a machine without a network hears so at once.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.errors import ModelLoadError

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
"""What training needs from a hub repository: configs, safetensors weights, tokenizer files (never pickles)."""

FETCH_HINT = "fetch it from the Hugging Face hub with the Dataset page's button (a few MB), or choose another model"
NOT_HERE = "it is not on this computer"
OFFLINE_MODE = "offline mode is on"
"""Words of the errors that no button can fix: the app offers "Look up … on the hub" only without them."""
HUB_CONNECT_TIMEOUT_S = 5.0
"""How long the one connection that checks the hub may take before a download is given up."""

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


def reach_hub(timeout_s: float = HUB_CONNECT_TIMEOUT_S) -> None:
    """One connection to the hub's host before a download, so that an unreachable hub is said at once:
    huggingface_hub retries a failed connection five times with backoff (23 s a file, two files for a tokenizer).
    Behind a proxy the host is not reached directly: nothing is checked there."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    endpoint = urlsplit(constants.ENDPOINT)
    if urllib.request.getproxies().get(endpoint.scheme):
        return
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ModelLoadError(
            f"cannot reach the Hugging Face hub ({host}): {err}",
            hint="check the network and press the button again, or choose a model that is on this computer",
        ) from err


def tokenizer_missing(model_name: str) -> str:
    """Why ``model_name``'s tokenizer cannot be read here, in words ("" when it can): not on this computer, or not
    here with offline mode on. A lookup on disk: nothing is sent."""
    from huggingface_hub import try_to_load_from_cache

    from engine.model import load

    if load.resolve_model(model_name).is_local or isinstance(try_to_load_from_cache(model_name, "tokenizer.json"), str):
        return ""
    return f"{NOT_HERE} and {OFFLINE_MODE}: it cannot be fetched" if load.hub_offline() else NOT_HERE


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
    if not hub_offline():
        reach_hub()
    try:
        return Path(hf_hub_download(name, "config.json", local_files_only=hub_offline()))
    except Exception as err:
        raise hub_error(name, err) from err


def tokenizer_on_disk(model_name: str, use_hub: bool = False) -> Any:
    """``model_name``'s tokenizer from its folder or the Hugging Face cache; from the hub only when ``use_hub`` (the
    user asked). Nothing is sent unasked: a hub id is never looked up, not even for updates."""
    from engine.model import load

    with TOKENIZER_LOCK:
        if load.resolve_model(model_name).is_local:
            return load.load_tokenizer(ModelConfig(name=model_name))
        if use_hub and not load.hub_offline():
            reach_hub()
            return load.load_tokenizer(ModelConfig(name=model_name))
        return _cached_tokenizer(model_name)


def _cached_tokenizer(model_name: str) -> Any:
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoTokenizer

    from engine.model.load import hub_offline

    cached = try_to_load_from_cache(model_name, "tokenizer.json")
    if not isinstance(cached, str) and hub_offline():
        hint = "unset HF_HUB_OFFLINE to fetch it from the Hugging Face hub, or choose another model"
        raise ModelLoadError(f"{NOT_HERE} and {OFFLINE_MODE}: it cannot be fetched", hint=hint)
    if not isinstance(cached, str):
        raise ModelLoadError(NOT_HERE, hint=FETCH_HINT)
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

    if not hub_offline():
        reach_hub()
    try:
        folder = snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=hub_offline(),
                                   tqdm_class=progress_bar_class(report))  # fmt: skip
    except Exception as err:
        raise hub_error(name, err) from err
    return Path(str(folder))
