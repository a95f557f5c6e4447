"""What the benchmarks against TRL (engine.bench.dpo, engine.bench.grpo) share: each side in a fresh process, the
TuneDeck side through ``tunedeck train --json`` and the TRL side through the bench module's own ``--side trl``, and
the report's common pieces."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""TRL's side reads the local folder and file only; without these, a machine with no network waits on the hub."""

SIDES: dict[str, list[str]] = {
    "trl": [],
    "tunedeck": [],
    "trl-no_ckpt": ["--no-checkpointing"],
    "tunedeck+standard_ckpt": ["--checkpointing", "standard"],
}
"""Each side's extra arguments: TRL without gradient checkpointing against TuneDeck without (its automatic choice
where memory is plenty), and TuneDeck with recompute against TRL's default."""


def memory_figures(device: Any) -> dict[str, int | None]:
    import torch

    from engine.hardware.vram import driver_bytes

    if device.type != "cuda":
        return {"peak_reserved_bytes": None, "peak_allocated_bytes": None, "driver_bytes": None}
    return {
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "driver_bytes": driver_bytes(device),
    }


def run_tunedeck(command: list[str], log: Path, cuda: bool) -> dict[str, Any]:
    """The run in a fresh process; each event with the parent's clock when it arrived."""
    from engine.bench.app_path import clean_environment

    events: list[dict[str, Any]] = []
    with log.with_suffix(".err").open("w") as err, subprocess.Popen(
        command, cwd=ROOT, env=clean_environment(), stdout=subprocess.PIPE, stderr=err, text=True
    ) as child:  # fmt: skip
        for line in child.stdout or []:
            if line.startswith("{"):
                try:
                    events.append({**json.loads(line), "arrived": time.perf_counter()})
                except json.JSONDecodeError:
                    continue
        returncode = child.wait()
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    steps = [e for e in events if e.get("kind") == "StepMetrics"]
    drivers = [s["driver_memory_bytes"] for s in steps if s.get("driver_memory_bytes")]
    states = [e["state"] for e in events if e.get("kind") == "SpeedChanged"]
    return {
        "returncode": returncode,
        "outcome": next((e["kind"] for e in events if e.get("kind") in ("RunFinished", "RunFailed")), "no end"),
        "steps": [_tunedeck_step(s) for s in steps],
        "peak_reserved_bytes": max((s["memory_bytes"] for s in steps), default=None) if cuda else None,  # else RSS
        "peak_allocated_bytes": None,
        "driver_bytes": max(drivers) if drivers else None,
        "settings": {
            "switches_on": sorted(k for k, v in (states[-1] if states else {}).items() if _is_on(v)),
            "checkpointing": (states[-1] if states else {}).get("checkpointing", {}).get("mode"),
        },
    }


def _tunedeck_step(event: dict[str, Any]) -> dict[str, Any]:
    kept = ("step", "loss", "tokens", "reward_accuracy", "epoch", "step_time_s")
    method = ("reward_mean", "completion_length", "generation_tokens_per_s", "update_tokens_per_s")  # GRPO's
    found = {key: event[key] for key in method if event.get(key) is not None}
    return {**{key: event.get(key) for key in kept}, **found, "ended": event["arrived"]}


def _is_on(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    return bool(value.get("on")) or value.get("mode") not in (None, "stock", "none")


def run_trl(module: str, work: Path, workload: Any, model: Path, data: Path, name: str, extra: list[str]) -> Any:
    """A TRL side in a fresh process (``python -m MODULE --side trl``) on ``workload`` (a dataclass), its log in
    ``work/logs/NAME.log`` and its result read back from ``work``."""
    from engine.bench.app_path import clean_environment

    result = work / "trl_result.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", module, "--side", "trl", "--model", str(model), "--data", str(data),
               "--work", str(work), "--result", str(result),
               "--workload", json.dumps(dataclasses.asdict(workload)), *extra]  # fmt: skip
    with (work / "logs" / f"{name}.log").open("w") as log:
        returncode = subprocess.run(command, cwd=ROOT, env={**clean_environment(), **OFFLINE}, stdout=log,
                                    stderr=subprocess.STDOUT, check=False).returncode  # fmt: skip
    if returncode or not result.exists():
        return {"returncode": returncode, "outcome": "RunFailed", "steps": []}
    return {"returncode": 0, "outcome": "RunFinished", **json.loads(result.read_text())}


def add_child_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden arguments the parent hands the TRL side's process."""
    parser.add_argument("--side", choices=("trl",), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--no-checkpointing", action="store_true", help=argparse.SUPPRESS)


def recomputes(settings: dict[str, Any]) -> bool | None:
    """Whether a side recomputes activations in backward (transformers' checkpointing, or TuneDeck's standard or
    offloaded); None where its settings do not say."""
    if "gradient_checkpointing" in settings:
        return bool(settings["gradient_checkpointing"])
    mode = settings.get("checkpointing")
    if "resident_layers" in settings.get("switches_on", []):
        return None  # resident layers skip the recompute where memory allows: neither with it nor without
    return None if mode in (None, "auto") else mode != "none"


def checkpointing_text(settings: dict[str, Any]) -> str:
    if "gradient_checkpointing" in settings:
        return "transformers' recompute" if settings["gradient_checkpointing"] else "none"
    return str(settings.get("checkpointing") or "–")


def number(value: float | None) -> str:
    return f"{value:,.0f}" if value else "–"


def ratios(sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each side's tokens/s over the ``trl`` side's (TRL's defaults)."""
    base = sides.get("trl", {}).get("figures", {}).get("tokens_per_s")
    rates = {name: side["figures"]["tokens_per_s"] for name, side in sides.items()}
    return {name: round(rate / base, 3) for name, rate in rates.items() if rate and base}


def chosen_sides(text: str, known: dict[str, list[str]], bench: str) -> list[str]:
    """The comma-separated sides of ``--sides``, each one ``known`` (else a SystemExit naming the known ones)."""
    names = text.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"tunedeck bench {bench}: unknown sides {unknown}; known: {', '.join(known)}")
    return names


def measure_sides(
    names: list[str], run: Callable[[str], dict[str, Any]], summarize: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Each side run one after the other, its figures summarized with its wall time and printed as a JSON line."""
    sides: dict[str, dict[str, Any]] = {}
    for name in names:
        started = time.perf_counter()
        side = run(name)
        side["figures"] = {**summarize(side), "wall_s": round(time.perf_counter() - started)}
        sides[name] = side
        print(json.dumps({"side": name, **side["figures"]}), flush=True)
    return sides


def side_records(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report's per-side entries: what each ran with, its figures and its rate against TRL's defaults."""
    return {
        "settings": {name: side.get("settings", {}) for name, side in sides.items()},
        "sides": {name: side["figures"] for name, side in sides.items()},
        "ratio": ratios(sides).get("tunedeck"),
        "ratios": ratios(sides),
    }


def finished(sides: dict[str, dict[str, Any]]) -> int:
    """The bench's exit status: 0 where every side finished."""
    return 0 if all(side["outcome"] == "RunFinished" for side in sides.values()) else 1
