"""A run's folder: the files it holds, creating it, reading its saved config, and writing logs and the adapter.

Everything a user keeps lands here: ``config.json``, ``metrics.jsonl``, ``eval.jsonl``, ``checkpoints/``, the
final ``adapter/`` (PEFT format) and, with held-out data, ``adapter-best/`` (engine.run.best). The folder is one
plain folder inside the output folder, never the output folder, its parent or a link's target, and it gets the
marker ``.tunedeck-run`` (its run id) first, so that deleting the run later removes only what TuneDeck wrote
(engine.run.ownership). The config and
the adapters are written atomically and the logs one whole line at a time (engine.run.checkpoint), so a kill at
any moment leaves a folder that a resume can read. A failed write raises an error that names the disk problem.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import traceback
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.config import RunConfig, run_name_problem
from engine.errors import ConfigError
from engine.model.adapter import BEST_ADAPTER
from engine.redact import redact
from engine.run import checkpoint as ckpt
from engine.run.ownership import new_run_id, write_marker
from engine.speed.stand_in import own_tree

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
MEMORY_FILE = "memory.jsonl"
"""What out-of-memory steps lowered and when it was tried again, one line per change (engine.run.guard)."""
ADAPTER_DIR = "adapter"
BEST_ADAPTER_DIR = BEST_ADAPTER
"""The adapter of the lowest held-out loss, with ``best.json`` (its step and loss), beside ``adapter/``."""
CHECKPOINT_DIR = "checkpoints"
COMPUTE_FILE = "compute.json"
"""The dtype the run computed in (``auto`` resolved on its machine): a merged export keeps it (engine.export)."""


def load_run_config(run_dir: Path) -> RunConfig:
    """The run's saved config; a damaged or hand-edited one is a ConfigError that names the file."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"{run_dir} is not a TuneDeck run folder (no {CONFIG_FILE})")
    try:
        return RunConfig.load(path)
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a TuneDeck config") from None
    except ConfigError as err:
        if str(path) in err.message:
            raise
        raise ConfigError(f"{path}: {err.message}", err.hint) from err


def new_run_dir(config: RunConfig) -> Path:
    """Create the run's folder inside the output folder, with its marker and ``config.json``."""
    parent = Path(config.output.dir).expanduser()
    name = config.output.name or _default_run_name(config)
    problem = run_name_problem(name)
    if problem is not None:  # OutputConfig checks it too; a config built by hand reaches here unchecked
        raise ConfigError(f"output.name: {name!r} {problem}")
    run_dir = parent / name
    if (run_dir / CONFIG_FILE).exists():
        if config.output.name:
            raise ConfigError(
                f"run folder {run_dir} already exists", hint="pass --resume to continue it, or another --name"
            )
        run_dir = parent / f"{name}-{random.randrange(16**4):04x}"
    check_inside(run_dir, parent)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_marker(run_dir, new_run_id())
        ckpt.write_text_atomic(run_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")
    except OSError as err:
        raise ckpt.write_error(err, "run folder", run_dir) from err
    return run_dir


def check_inside(run_dir: Path, parent: Path) -> None:
    """Refuse a run folder that is not a folder of its own directly inside ``parent`` once links are followed."""
    if run_dir.is_symlink() or run_dir.resolve().parent != parent.resolve():
        raise ConfigError(
            f"run folder {run_dir} leads to {run_dir.resolve()}, outside the output folder {parent}",
            hint="choose another --name, or another output folder",
        )


def _default_run_name(config: RunConfig) -> str:
    model = _name_part(Path(config.model.name).name, "model")
    data = _name_part(Path(config.data.path).stem, "data")
    return f"{datetime.now():%Y%m%d-%H%M%S}-{model}-{data}"


def _name_part(text: str, fallback: str) -> str:
    """``text`` made fit for a folder name: an Ollama model's name has colons (ollama:smollm2:135m), which Windows
    refuses, and a file's name may hold control characters. Cut to 40 characters and 100 bytes, so that the whole
    name stays inside engine.config's limits."""
    text = "".join("-" if unicodedata.category(char) in ("Cc", "Cs") else char for char in text)
    text = re.sub(r'[<>:"/\\|?*]+', "-", text)[:40]
    while len(text.encode("utf-8")) > 100:
        text = text[:-1]
    return re.sub(r"^[\s.-]+|[\s.-]+$", "", text) or fallback


def write_compute(run_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
    record = {"dtype": str(dtype).removeprefix("torch."), "device": device.type}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_text_atomic(run_dir / COMPUTE_FILE, json.dumps(record) + "\n")
    except OSError as err:
        raise ckpt.write_error(err, "run folder", run_dir) from err


def write_error_log(run_dir: Path | None, err: Exception) -> Path | None:
    if run_dir is None or not run_dir.exists():
        return None
    log = run_dir / "error.log"
    try:
        log.write_text(redact("".join(traceback.format_exception(err))), encoding="utf-8")
    except OSError:  # a full disk must not turn the failure report into a second failure
        return None
    return log


def truncate_log(path: Path, last_step: int) -> None:
    """Drop records written after the checkpoint, so the resumed curve continues without duplicates."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if _line_step(line) <= last_step]
    ckpt.write_text_atomic(path, "".join(line + "\n" for line in kept))


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line from a crash is dropped


@dataclass(frozen=True)
class AdapterContents:
    """An adapter as PEFT saves it: its weights under peft's names, on the host, and its config."""

    weights: dict[str, torch.Tensor]
    config: Any


def adapter_contents(model: Any, state_dict: dict[str, torch.Tensor] | None = None) -> AdapterContents:
    """The model's adapter as it is now, taken with the speed stand-ins seen through (peft finds its LoRA layers by
    class, and a layer behind a stand-in would be left out). Between steps only: it swaps modules for a moment.
    ``state_dict``: the trainable weights gathered by FSDP2."""
    import copy

    from peft import get_peft_model_state_dict

    with own_tree(model):
        weights = get_peft_model_state_dict(model, state_dict=state_dict)
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    config.inference_mode = True
    return AdapterContents({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}, config)


def write_adapter(folder: Path, contents: AdapterContents, tokenizer: Any, extra: dict[str, str] | None = None) -> Path:
    """Write ``contents`` in PEFT format (with the tokenizer and any ``extra`` files) atomically; safe in a thread
    beside training, since it touches only the host copy."""
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file(contents.weights, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        contents.config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        ckpt.commit_folder(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def save_adapter(model: Any, tokenizer: Any, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter in PEFT format (with the tokenizer) atomically; ``state_dict``: weights gathered by FSDP2."""
    return write_adapter(folder, adapter_contents(model, state_dict), tokenizer)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One write per record: a kill can only tear the last line, which resuming drops."""
    try:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as err:
        raise ckpt.write_error(err, f"training log {path.name}", path.parent) from err
