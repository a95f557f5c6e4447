"""Models already on this computer as GGUF files: a ``.gguf`` path, the Ollama store and LM Studio's models folder.

Hobbyists keep their models in Ollama or LM Studio, and a gated hub model is often already in their Ollama store.
TuneDeck starts from them with no Ollama process and no hub: Ollama's store is read directly (a manifest per
``NAME/TAG`` names the ``sha256-…`` blob that holds the weights; ``OLLAMA_MODELS`` moves the store), LM Studio's
folder (``PUBLISHER/REPO/*.gguf``) is scanned. Each model is described from its GGUF header alone, by the small
reader below: it skips the tokenizer's arrays instead of decoding them (the ``gguf`` package's reader decodes all
of them and took 4.7 s for SmolLM2-135M's header on two busy cores; this one reads it in milliseconds), so a
gallery of many models lists at once.

What ``--model`` takes for each: the file's path, ``ollama:NAME[:TAG]`` (or just ``NAME:TAG``: a hub id never
has a colon) and ``lmstudio:PUBLISHER/REPO[/FILE.gguf]``. :mod:`engine.model.gguf_import` turns one into a
Hugging Face folder, once.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

OLLAMA_PREFIX = "ollama:"
LMSTUDIO_PREFIX = "lmstudio:"
GGUF_MAGIC = b"GGUF"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
NOT_ARCHITECTURES = {"general", "tokenizer"}
"""Entries of transformers' list of GGUF 'architectures' that are metadata sections, not model families."""
NOT_CAUSAL = {"t5", "umt5"}
"""Families transformers reads from GGUF but not as a causal language model (what TuneDeck trains)."""


# ------------------------------------------------------------------------------------------------ the header


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file's header says about the model, without its tensors' data."""

    architecture: str
    title: str
    """``general.name``, or '' when the file has none."""
    file_type: str
    """The quantization the file was made as (``general.file_type``: 'Q4_1', 'Q4_K_M', 'F16'), or ''."""
    tensor_types: tuple[tuple[str, int], ...]
    """(GGML type, number of tensors), most common first."""
    parameters: int
    has_chat_template: bool

    @property
    def quantization(self) -> str:
        """The file's quantization in one word: its file type, else the most common type of its weights."""
        if self.file_type:
            return self.file_type
        return self.tensor_types[0][0] if self.tensor_types else "unknown"

    def describe_types(self) -> str:
        """'Q4_1 ×210, F32 ×61, Q8_0 ×1'."""
        return ", ".join(f"{kind} ×{count}" for kind, count in self.tensor_types)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEPT = {"general.architecture", "general.name", "general.file_type", "tokenizer.chat_template"}


class _Cursor:
    """Reads little-endian values from a mapped file, front to back."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        text = bytes(self.data[self.pos : self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return text

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            length = self.unpack("<Q")
            self.pos += length
        elif kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                width = struct.calcsize(_SCALARS[item])
                self.pos += width * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_header(path: Path) -> GgufHeader:
    """The architecture, quantization, tensor types and size of the GGUF file at ``path``."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_header(_Cursor(data))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as err:
        raise ModelLoadError(f"cannot read the GGUF header of {path}: {err}") from err


def _parse_header(cursor: _Cursor) -> GgufHeader:
    if bytes(cursor.data[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old (re-convert it with a current llama.cpp)")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    kept: dict[str, Any] = {}
    for _ in range(kv_count):
        key, kind = cursor.string(), cursor.unpack("<I")
        if key in _KEPT and kind == _STRING:
            kept[key] = cursor.string()
        elif key in _KEPT and kind in _SCALARS:
            kept[key] = cursor.unpack(_SCALARS[kind])
        else:
            cursor.skip_value(kind)
    types: Counter[str] = Counter()
    parameters = 0
    for _ in range(tensor_count):
        cursor.string()
        dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
        types[_ggml_type_name(cursor.unpack("<I"))] += 1
        cursor.unpack("<Q")  # offset of the data
        count = 1
        for dim in dims:
            count *= dim
        parameters += count
    return GgufHeader(
        architecture=str(kept.get("general.architecture", "")),
        title=str(kept.get("general.name", "")),
        file_type=_file_type_name(kept.get("general.file_type")),
        tensor_types=tuple(types.most_common()),
        parameters=parameters,
        has_chat_template=bool(kept.get("tokenizer.chat_template")),
    )


def _ggml_type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def _file_type_name(value: Any) -> str:
    from gguf import LlamaFileType

    if not isinstance(value, int):
        return ""
    try:
        name = LlamaFileType(value).name
    except ValueError:
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


# ------------------------------------------------------------------------------------------------ families


def transformers_gguf_families() -> list[str]:
    """The model families transformers reads from GGUF as a causal language model, from transformers' own lists."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    families = set(GGUF_SUPPORTED_ARCHITECTURES)
    try:  # transformers 5.24+: architectures its newer GGUF loader reads (listed under their GGUF names)
        from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS

        families |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(families - NOT_ARCHITECTURES - NOT_CAUSAL)


def transformers_name(architecture: str) -> str:
    """A GGUF architecture under transformers' spelling: 'qwen3moe' -> 'qwen3_moe', 'gpt-oss' -> 'gpt_oss'."""
    return re.sub(r"(\d)moe$", r"\1_moe", architecture.replace("-", "_"))


def transformers_reads(architecture: str) -> bool:
    families = transformers_gguf_families()
    return architecture in families or transformers_name(architecture) in families


# ------------------------------------------------------------------------------------------------ the models


@dataclass(frozen=True)
class LocalGguf:
    """One GGUF model on this computer, as the gallery lists it and ``--model`` names it."""

    name: str
    """What ``--model`` takes: the file's path, 'ollama:NAME:TAG' or 'lmstudio:PUBLISHER/REPO/FILE.gguf'."""
    path: Path
    """The GGUF file (an Ollama blob has no .gguf suffix)."""
    origin: str
    """'file', 'ollama' or 'lmstudio'."""
    label: str
    """A short name for run folders and titles."""
    size_bytes: int
    header: GgufHeader
    identity: str
    """Names this exact file: the blob's digest for Ollama, else a hash of its path, size and modification time."""

    @property
    def readable(self) -> bool:
        """Whether transformers can read this file's family from GGUF."""
        return transformers_reads(self.header.architecture)


def describe_file(path: Path, name: str, origin: str, label: str, identity: str | None = None) -> LocalGguf:
    stat = path.stat()
    if identity is None:
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        identity = hashlib.sha256(key.encode()).hexdigest()
    return LocalGguf(name, path, origin, label, stat.st_size, read_header(path), identity)


def ollama_models_dir() -> Path:
    """Ollama's store: ``OLLAMA_MODELS`` when set, else ``~/.ollama/models``."""
    override = os.environ.get("OLLAMA_MODELS")
    return Path(override).expanduser() if override else Path.home() / ".ollama" / "models"


def lmstudio_models_dirs() -> list[Path]:
    """LM Studio's models folders: ``~/.lmstudio/models`` and the older ``~/.cache/lm-studio/models``."""
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def _ollama_display_name(parts: tuple[str, ...]) -> str:
    """Manifest path parts (host, namespace..., model, tag) as Ollama shows the name: 'smollm2:135m' for the
    library, 'user/model:tag' for a user's model, 'hf.co/org/repo:tag' for another registry."""
    *where, model, tag = parts
    if where[:2] == [OLLAMA_REGISTRY, "library"]:
        prefix = ""
    elif where[:1] == [OLLAMA_REGISTRY]:
        prefix = "/".join(where[1:]) + "/"
    else:
        prefix = "/".join(where) + "/"
    return f"{prefix}{model}:{tag}"


def _ollama_manifests(root: Path) -> Iterator[tuple[str, Path]]:
    """(display name, manifest file) for every model in the store."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for path in sorted(p for p in manifests.rglob("*") if p.is_file()):
        parts = path.relative_to(manifests).parts
        if len(parts) >= 3:
            yield _ollama_display_name(parts), path


def _ollama_blob(root: Path, manifest: Path) -> tuple[Path, str] | None:
    """The weights' blob a manifest names, with its digest; None when the manifest has no model layer."""
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            digest = str(layer.get("digest", ""))
            return root / "blobs" / digest.replace(":", "-"), digest
    return None


def _ollama_entry(root: Path, display: str, manifest: Path) -> LocalGguf | None:
    found = _ollama_blob(root, manifest)
    if found is None or not found[0].is_file() or not is_gguf(found[0]):
        return None
    blob, digest = found
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", display.rsplit("/", 1)[-1])
    return describe_file(blob, OLLAMA_PREFIX + display, "ollama", label, identity=digest.split(":")[-1])


def list_ollama(root: Path | None = None) -> list[LocalGguf]:
    root = root or ollama_models_dir()
    found = (_ollama_entry(root, display, manifest) for display, manifest in _ollama_manifests(root))
    return [model for model in found if model is not None]


def _model_files(folder: Path) -> list[Path]:
    """A repository folder's model files: not vision projectors (mmproj-*), not the later parts of a split file."""
    files = sorted(folder.glob("*.gguf"))
    return [f for f in files if not f.name.lower().startswith("mmproj") and not re.search(r"-0000[2-9]-of-", f.name)]


def list_lmstudio(roots: list[Path] | None = None) -> list[LocalGguf]:
    found: list[LocalGguf] = []
    for root in roots if roots is not None else lmstudio_models_dirs():
        if not root.is_dir():
            continue
        for path in sorted(p for repo in root.glob("*/*") if repo.is_dir() for p in _model_files(repo)):
            relative = path.relative_to(root).as_posix()
            try:
                found.append(describe_file(path, LMSTUDIO_PREFIX + relative, "lmstudio", path.stem))
            except ModelLoadError:
                continue  # a damaged or half-downloaded file: not listed
    return found


def list_local_models() -> list[LocalGguf]:
    """Every GGUF model in the Ollama store and LM Studio's folders."""
    return [*list_ollama(), *list_lmstudio()]


# ------------------------------------------------------------------------------------------------ names


def is_local_gguf_name(name: str) -> bool:
    """Whether ``name`` names a GGUF model (by prefix, an Ollama NAME:TAG, or a GGUF file) rather than a folder
    or a hub id; cheap: reads at most four bytes."""
    if name.startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX)):
        return True
    path = Path(name).expanduser()
    if path.is_dir():
        return False
    if path.is_file():
        return path.suffix.lower() == ".gguf" or is_gguf(path)
    return name.lower().endswith(".gguf") or _looks_like_ollama_name(name)


def _looks_like_ollama_name(name: str) -> bool:
    return ":" in name and not re.match(r"^[A-Za-z]:[\\/]", name) and not name.startswith((".", "/", "~"))


def find_local_model(name: str) -> LocalGguf | None:
    """The GGUF model ``name`` names, None when it names a folder or a hub id; ModelLoadError when it names a
    GGUF model that is not there."""
    if not is_local_gguf_name(name):
        return None
    if name.startswith(LMSTUDIO_PREFIX):
        return _lmstudio_model(name.removeprefix(LMSTUDIO_PREFIX))
    path = Path(name).expanduser()
    if path.is_file():
        resolved = path.resolve()
        return describe_file(resolved, str(resolved), "file", resolved.stem)
    if name.startswith(OLLAMA_PREFIX) or _looks_like_ollama_name(name):
        return _ollama_model(name.removeprefix(OLLAMA_PREFIX))
    raise ModelLoadError(f"GGUF file not found: {name}")


def _ollama_model(wanted: str) -> LocalGguf:
    root = ollama_models_dir()
    full = wanted if ":" in wanted.rsplit("/", 1)[-1] else f"{wanted}:latest"
    for display, manifest in _ollama_manifests(root):
        if display == full:
            model = _ollama_entry(root, display, manifest)
            if model is None:
                raise ModelLoadError(
                    f"the Ollama model {full} has no GGUF weights in {root / 'blobs'}",
                    hint=f"run `ollama pull {full}` again",
                )
            return model
    names = [display for display, _ in _ollama_manifests(root)]
    listed = f"; it has {', '.join(names[:8])}" if names else " (it has no models)"
    raise ModelLoadError(
        f"no Ollama model {full} in {root}{listed}",
        hint="`ollama list` shows the names; set OLLAMA_MODELS if your store is elsewhere",
    )


def _lmstudio_model(wanted: str) -> LocalGguf:
    for root in lmstudio_models_dirs():
        target = root / wanted
        if target.is_file():
            return describe_file(target, LMSTUDIO_PREFIX + wanted, "lmstudio", target.stem)
        files = _model_files(target) if target.is_dir() else []
        if len(files) == 1:
            relative = files[0].relative_to(root).as_posix()
            return describe_file(files[0], LMSTUDIO_PREFIX + relative, "lmstudio", files[0].stem)
        if files:
            choices = ", ".join(f.name for f in files)
            raise ModelLoadError(
                f"{target} holds {len(files)} GGUF files ({choices})",
                hint=f"name one: lmstudio:{wanted}/{files[0].name}",
            )
    raise ModelLoadError(
        f"no LM Studio model {wanted} in {' or '.join(str(r) for r in lmstudio_models_dirs())}",
        hint="give PUBLISHER/REPO or PUBLISHER/REPO/FILE.gguf as LM Studio's models folder lays them out",
    )
