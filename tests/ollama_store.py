"""Laying a GGUF file out in a folder as Ollama's store holds it (``ollama create`` / ``ollama pull``): a blob named
by its sha256 and a manifest per ``NAME/TAG`` naming it, so tests can point OLLAMA_MODELS at it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

OLLAMA_MEDIA = "application/vnd.ollama.image"


def add_to_ollama_store(store: Path, gguf: Path, name: str, tag: str, params: dict[str, Any] | None = None) -> str:
    """Put ``gguf`` into ``store`` as the library model ``name:tag`` (a link to it, or a copy); returns its digest."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{digest}"
    if not blob.exists():
        try:
            os.symlink(gguf, blob)
        except OSError:
            shutil.copyfile(gguf, blob)
    layers = [{"mediaType": f"{OLLAMA_MEDIA}.model", "digest": f"sha256:{digest}", "size": blob.stat().st_size}]
    if params is not None:
        text = json.dumps(params).encode()
        params_digest = hashlib.sha256(text).hexdigest()
        (blobs / f"sha256-{params_digest}").write_bytes(text)
        layers.append({"mediaType": f"{OLLAMA_MEDIA}.params", "digest": f"sha256:{params_digest}", "size": len(text)})
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    config = {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64, "size": 2}
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": config, "layers": layers}))
    return digest
