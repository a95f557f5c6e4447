"""What one run leaves for the next: compiled kernels in a persistent cache, and what its warm-up measured.

Why: every run used to pay its one-off work again, however often the same model had trained before. On the H200
(SmolLM2-135M, 512-token rows) a 21-step run with automatic switches took 40.4 s, 35-40 s of it compiling layer
regions, capturing step graphs and timing them against eager steps; a second identical run with inductor's cache
warm still took 49 s against 66 s. Two things carry over here:

* **Inductor's caches** (compiled FX graphs, AOTAutograd's forward/backward graphs, Triton kernels) go to the user's
  data folder instead of the system's temp folder, which the OS clears (:func:`use_compile_cache`): a later run of
  the same model and shapes loads its kernels instead of compiling them. A folder the user chose
  (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) is left alone. Deleting the folder only costs a recompile.
* **Decisions and measurements** (:class:`DecisionStore`): one small JSON file keyed by GPU, torch version, model
  fingerprint and row-shape bucket holds the step-graph trial's verdict and the measured compile, capture and step
  times, so a repeated run skips the trial and knows what compiling costs it (:mod:`engine.speed.warm_up` reads them).
  Writes are atomic (a temporary file, then ``os.replace``); a missing, unreadable or damaged file reads as empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.hardware.shapes import ModelShape

__all__ = [
    "COMPILE_CACHE_DIR",
    "DECISIONS_FILE",
    "DecisionKey",
    "DecisionStore",
    "GraphTrial",
    "Measured",
    "model_fingerprint",
    "row_bucket",
    "use_compile_cache",
]

COMPILE_CACHE_DIR = "compile_cache"
"""Inductor's and Triton's caches, under the user's data folder."""
DECISIONS_FILE = "speed_decisions.json"
"""The decisions store, in the user's data folder."""
MAX_ENTRIES = 200
"""Entries kept in the store; the least recently updated go first."""
FORMAT = 1


def use_compile_cache(data_folder: Path) -> Path:
    """Point inductor's and Triton's on-disk caches into ``data_folder`` (unless the user chose folders of their
    own) and turn on the FX-graph and AOTAutograd caches; returns the inductor cache folder in use.

    Call it before anything compiles: both read their folders when they first write or look up a kernel."""
    folder = data_folder / COMPILE_CACHE_DIR
    inductor = _set_unless_chosen("TORCHINDUCTOR_CACHE_DIR", folder / "inductor", _inductor_default())
    _set_unless_chosen("TRITON_CACHE_DIR", folder / "triton", None)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return Path(inductor)


def _set_unless_chosen(name: str, ours: Path, default: str | None) -> str:
    """``os.environ[name] = ours`` unless it already names a folder other than torch's own default."""
    current = os.environ.get(name)
    if current and (default is None or os.path.abspath(current) != os.path.abspath(default)):
        return current
    os.environ[name] = str(ours)
    return str(ours)


def _inductor_default() -> str | None:
    """Inductor's temp-folder default, which inductor itself writes into the environment once it has used it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return default_cache_dir()


# --- keys -------------------------------------------------------------------------------------------------------


def row_bucket(tokens: int) -> int:
    """The row-shape bucket of a run whose longest packed row has ``tokens`` tokens: the next power of two."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def model_fingerprint(hf_model: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype) -> str:
    """A short hash of what the compiled graphs depend on: the architecture, the dtype, 4-bit layers and the
    trainable (LoRA) parameters' shapes. The weights' values do not matter and are not read."""
    shape = dataclasses.asdict(ModelShape.from_config(hf_model.config))
    shape.pop("name", None)
    four_bit = sorted({type(m).__name__ for m in model.modules() if "4bit" in type(m).__name__})
    trainable = [(name, list(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    text = json.dumps([shape, str(dtype), four_bit, trainable], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@dataclass(frozen=True)
class DecisionKey:
    """What a measurement holds for: the GPU, torch's version, the model and the row-shape bucket."""

    gpu: str
    torch: str
    model: str
    rows: int

    def text(self) -> str:
        return f"{self.gpu}|{self.torch}|{self.model}|{self.rows}"


# --- records ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphTrial:
    """The step-graph trial's verdict: a replayed micro-batch against an eager one, GPU milliseconds each."""

    keep: bool
    eager_ms: float
    replay_ms: float


@dataclass(frozen=True)
class Measured:
    """What earlier runs of the same key measured; None where nothing was measured yet."""

    compile_s: float | None = None
    """Seconds the first micro-batch spent beyond a settled one with fused kernels on (compiling)."""
    compile_runs: int = 0
    """Runs that compiled the fused kernels; from the second on, inductor's cache held them when measured."""
    graphs_s: float | None = None
    """Seconds the step-graph warm-up (eager runs of each new bucket, captures, the trial) cost beyond settled steps."""
    step_ms: float | None = None
    """A settled micro-batch, host milliseconds from one's start to the next's."""
    trials: dict[str, GraphTrial] = field(default_factory=dict)
    """The step-graph trial's verdict, per fused-kernel state (``"compiled"`` or ``"eager"``)."""
    updated: float = 0.0

    @property
    def compile_cached(self) -> bool:
        """The recorded compile time was measured with inductor's cache already holding the kernels."""
        return self.compile_runs >= 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Measured:
        """The record as stored; raises (KeyError, TypeError, ValueError) on a damaged one."""
        trials = {str(k): GraphTrial(bool(v["keep"]), float(v["eager_ms"]), float(v["replay_ms"]))
                  for k, v in dict(raw.get("trials") or {}).items()}  # fmt: skip
        return cls(
            compile_s=_number(raw.get("compile_s")),
            compile_runs=int(raw.get("compile_runs") or 0),
            graphs_s=_number(raw.get("graphs_s")),
            step_ms=_number(raw.get("step_ms")),
            trials=trials,
            updated=float(raw.get("updated") or 0.0),
        )


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


# --- the store --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecisionStore:
    """The decisions file: ``{"format": 1, "entries": {key text: record}}``. ``writable`` False: a rank other than
    the first reads the same decisions but leaves writing to it."""

    path: Path
    writable: bool = True

    @classmethod
    def in_folder(cls, data_folder: Path, writable: bool = True) -> DecisionStore:
        return cls(data_folder / DECISIONS_FILE, writable)

    def read(self, key: DecisionKey) -> Measured | None:
        """The record for ``key``; None when there is none, or the file is missing or damaged."""
        raw = self._entries().get(key.text())
        if not isinstance(raw, dict):
            return None
        try:
            return Measured.from_dict(raw)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def write(self, key: DecisionKey, measured: Measured) -> bool:
        """Store the record for ``key`` (atomically, the oldest entries dropped past :data:`MAX_ENTRIES`); False
        when the folder cannot be written, which only means the next run measures again."""
        if not self.writable:
            return False
        entries = self._entries()
        entries[key.text()] = dataclasses.replace(measured, updated=time.time()).to_dict()
        newest = sorted(entries.items(), key=lambda item: _updated(item[1]), reverse=True)[:MAX_ENTRIES]
        try:
            _write_atomically(self.path, json.dumps({"format": FORMAT, "entries": dict(newest)}, indent=1))
        except OSError:
            return False
        return True

    def _entries(self) -> dict[str, Any]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        entries = raw.get("entries") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
        return dict(entries) if isinstance(entries, dict) else {}


def _updated(record: Any) -> float:
    try:
        return float(record.get("updated") or 0.0)
    except (AttributeError, TypeError, ValueError):
        return 0.0


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then replace ``path`` with it: a reader sees the old file
    or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
