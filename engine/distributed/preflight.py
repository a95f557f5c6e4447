"""Before the first step of a run over several computers: every node must train the same thing.

Each node describes what it would train and the software it would train with, and every rank compares every node
with node 0, so all of them stop with the same single message when anything differs:

- the dataset: SHA-256 over its rows as the data reader sees them (each row as sorted-key JSON), so the same rows
  in a file with other line endings or key order still agree, and a changed, added or missing row does not;
- the base model: SHA-256 over its ``config.json`` (parsed), and for each weights file its name, size, safetensors
  header (every tensor's name, dtype, shape and offsets) and three 64 KiB samples of its bytes (start, middle,
  end). Reading ~200 KiB a file keeps it cheap on multi-GB checkpoints; two files with equal headers differing
  only outside the samples would pass (a fine-tune of the same shape differs throughout, so the samples catch it);
- TuneDeck, torch, transformers and peft versions;
- the settings, except those that are this computer's own (file paths, node rank, GPUs, device). Every node trains
  node 0's settings (engine.distributed.joined), so another node's command needs only its model and data: a
  setting it leaves at its default or automatic takes node 0's value, and only a value it sets that differs from
  node 0's is a mismatch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from engine.config import RunConfig
from engine.errors import ConfigError

SAMPLE_BYTES = 64 * 1024
LOCAL_SETTINGS = {
    ("model", "name"),
    ("data", "path"),
    ("data", "eval_path"),
    ("output", "dir"),
    ("output", "name"),
    ("training", "gpus"),
    ("training", "device"),
    ("training", "node_rank"),
    ("training", "rendezvous_timeout"),
}
VERSIONED = ("tunedeck", "torch", "transformers", "peft")


def node_identity(config: RunConfig, link: str) -> dict[str, Any]:
    """What this node would train and with what software; ``link`` (its network in words) is shown, not compared."""
    return {
        "dataset": dataset_fingerprint(config.data.path, config.data.eval_path),
        "model": model_fingerprint(config.model.name),
        "versions": {name: _version(name) for name in VERSIONED},
        "settings": comparable_settings(config),
        "link": link,
    }


def differences(node: int, mine: dict[str, Any], main: dict[str, Any]) -> list[str]:
    """How node ``node``'s identity differs from node 0's, one phrase per difference."""
    found = []
    for key, what in (("dataset", "the dataset's rows"), ("model", "the base model")):
        if mine[key] != main[key]:
            found.append(f"{what} (fingerprint {_short(main[key])} on node 0, {_short(mine[key])} on node {node})")
    for name in VERSIONED:
        if mine["versions"][name] != main["versions"][name]:
            found.append(f"{name} {main['versions'][name]} on node 0, {mine['versions'][name]} on node {node}")
    defaults = comparable_settings(RunConfig())
    for key, value in mine["settings"].items():
        theirs = main["settings"].get(key)
        if value is not None and value != defaults.get(key) and theirs is not None and value != theirs:
            found.append(f"setting {key} is {theirs!r} on node 0, {value!r} on node {node}")
    return found


def check_identities(identities: list[dict[str, Any]], node_of_rank: tuple[int, ...]) -> None:
    """Raise one ConfigError naming every difference of any node from node 0 (the same on every rank)."""
    unreadable = [(node_of_rank[r], i["problem"]) for r, i in enumerate(identities) if "problem" in i]
    if unreadable:
        node, problem = unreadable[0]
        raise ConfigError(f"node {node} cannot start: {problem}", hint="fix it on that computer and start both again")
    main = identities[0]
    problems: list[str] = []
    seen: set[int] = set()
    for rank, identity in enumerate(identities):
        node = node_of_rank[rank]
        if node in seen:
            continue
        seen.add(node)
        problems += differences(node, identity, main)
    if problems:
        raise ConfigError(
            "the nodes differ: " + "; ".join(problems),
            hint="give every computer the same dataset, base model, software versions and settings",
        )


def comparable_settings(config: RunConfig) -> dict[str, Any]:
    raw = config.to_dict()
    return {
        f"{section}.{name}": value
        for section, values in raw.items()
        if isinstance(values, dict)
        for name, value in values.items()
        if (section, name) not in LOCAL_SETTINGS
    }


def dataset_fingerprint(path: str, eval_path: str | None = None) -> str:
    from engine.data.files import read_rows

    digest = hashlib.sha256()
    for source in filter(None, [path, eval_path]):
        for row in read_rows(source):
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
            digest.update(b"\n")
        digest.update(b"\x00")
    return digest.hexdigest()


def model_fingerprint(name: str) -> str:
    """SHA-256 of the model's config and its weights files' names, sizes, headers and sampled bytes; a name that is
    not a local file or folder (the demo, a hub id) is its own fingerprint."""
    source = Path(name).expanduser()
    digest = hashlib.sha256()
    if not source.exists():
        digest.update(name.encode())
        return digest.hexdigest()
    config = source / "config.json"
    if config.is_file():
        digest.update(json.dumps(json.loads(config.read_text(encoding="utf-8")), sort_keys=True).encode())
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if _is_weights(p))
    for file in files:
        _weights_digest(digest, file)
    return digest.hexdigest()


def _is_weights(path: Path) -> bool:
    return path.is_file() and path.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def _weights_digest(digest: Any, file: Path) -> None:
    size = file.stat().st_size
    digest.update(f"{file.name}:{size}".encode())
    with file.open("rb") as handle:
        if file.suffix == ".safetensors":
            length = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(min(length, 100 * 1024 * 1024)))
        for start in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
            handle.seek(start)
            digest.update(handle.read(SAMPLE_BYTES))


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _short(fingerprint: str) -> str:
    return fingerprint[:12]
