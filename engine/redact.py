"""Keeping the Hugging Face token out of everything a run writes or reports.

TuneDeck never asks for the token: huggingface_hub reads it itself from ``HF_TOKEN`` (or the older
``HUGGING_FACE_HUB_TOKEN``) or from the standard cache file (``$HF_TOKEN_PATH``, else ``$HF_HOME/token``, else
``~/.cache/huggingface/token``). It can still leak through text we did not write: an HTTP error that echoes a
header, a traceback with a URL. So every message of a run, and every error log, passes through :func:`redact`,
which replaces the user's actual token and anything shaped like a Hugging Face token (``hf_`` + 30 or more
letters and digits) with ``hf_***``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path
from typing import TypeVar

TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
TOKEN_SHAPE = re.compile(r"hf_[A-Za-z0-9]{30,}")
MASK = "hf_***"
E = TypeVar("E")


def token_file() -> Path:
    """Where huggingface_hub keeps a token saved by ``hf auth login``."""
    explicit = os.environ.get("HF_TOKEN_PATH")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "token"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface" / "token"


def known_tokens() -> list[str]:
    """The token values this user has configured (environment and cache file); never logged."""
    found = [os.environ.get(name, "").strip() for name in TOKEN_ENV_VARS]
    with contextlib.suppress(OSError, UnicodeDecodeError):
        found.append(token_file().read_text(encoding="utf-8").strip())
    return [token for token in found if len(token) >= 8]


def redact(text: str, tokens: list[str] | None = None) -> str:
    """``text`` with the user's token and anything token-shaped masked."""
    for token in known_tokens() if tokens is None else tokens:
        text = text.replace(token, MASK)
    return TOKEN_SHAPE.sub(MASK, text)


def redact_event(event: E, tokens: list[str]) -> E:
    """The event with every text field redacted (the same object when nothing needed masking)."""
    if not dataclasses.is_dataclass(event) or isinstance(event, type):
        return event
    changes = {}
    for item in dataclasses.fields(event):
        value = getattr(event, item.name)
        if isinstance(value, str):
            cleaned = redact(value, tokens)
            if cleaned != value:
                changes[item.name] = cleaned
    return dataclasses.replace(event, **changes) if changes else event
