"""``tunedeck train --demo``: fine-tune the built-in model on the demo task and show what it learned.

The held-out demo examples are answered by the base model before training and by base + the new adapter
(loaded back from the run folder, as a user would) after it; both exact-match accuracies are printed and saved
as ``demo_result.json`` in the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import DEMO_MODEL, RunConfig
from engine.run.control import RunControl

if TYPE_CHECKING:
    from engine.demo import GenerativeModel

# The recipe that teaches the demo task in about half a minute on two CPU cores: 2 epochs of 256-token packed rows
# (~710 steps) take the base model from 0% to 84-96% exact match over seeds (demo model of resources/demo), as the
# former 4 epochs of 1,024-token rows (~340 steps) did with twice the tokens. A step costs about its tokens on a
# CPU, so smaller batches buy more updates for the same time (2 epochs of 512 tokens: 74-87%; of 1,024: 83%).
DEMO_SETTINGS: dict[str, dict[str, Any]] = {
    "data": {"max_seq_len": 128, "tokens_per_batch": 256, "eval_fraction": 0.02},
    "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0},
    "training": {
        "max_steps": 0,
        "epochs": 2.0,
        "learning_rate": 3e-3,
        "warmup_steps": 10,
        "schedule": "cosine",
        "eval_every": 0,
        "save_every": 100,
        "keep_knowledge": False,
    },
}


def demo_config(base: RunConfig) -> RunConfig:
    """The demo model, data and recipe on top of ``base`` (explicit flags are applied after this)."""
    from engine.demo import DEMO_TRAIN_FILE

    raw = base.to_dict()
    raw["model"]["name"] = DEMO_MODEL
    raw["data"]["path"] = str(DEMO_TRAIN_FILE)
    for section, values in DEMO_SETTINGS.items():
        raw[section].update(values)
    return RunConfig.from_dict(raw)


def demo_accuracy(config: RunConfig, adapter_dir: Path | None) -> tuple[float, int]:
    """Exact-match accuracy on the held-out demo examples, of the base model or base + adapter."""
    from engine.demo import DEMO_EVAL_FILE, evaluate_accuracy
    from engine.model.load import load_base_model, load_tokenizer, pick_device, pick_dtype

    device = pick_device(config.training.device)
    model_config = dataclasses.replace(config.model, qlora=False)
    tokenizer = load_tokenizer(model_config)
    model: GenerativeModel = load_base_model(model_config, device, pick_dtype(config.model.dtype, device))
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    rows = [json.loads(line) for line in Path(DEMO_EVAL_FILE).read_text(encoding="utf-8").splitlines() if line]
    return evaluate_accuracy(model, tokenizer, rows), len(rows)


def run_demo(config: RunConfig, control: RunControl, *, json_lines: bool = False) -> int:
    from engine.cli.progress import print_report, run_events

    started = time.perf_counter()
    before, count = demo_accuracy(config, None)
    print(f"demo task: convert dates to ISO format; base model accuracy on {count} held-out examples: {before:.0%}")
    printer = run_events(config, control, resume=None, json_lines=json_lines)
    if printer.failed or printer.finished is None:
        print(printer.summary(), file=sys.stderr)
        return 1
    after, _ = demo_accuracy(config, Path(printer.finished.adapter_dir))
    wall = time.perf_counter() - started
    result = {"accuracy_before": before, "accuracy_after": after, "examples": count, "wall_time_s": wall}
    Path(printer.finished.run_dir, "demo_result.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(printer.summary())
    print(f"demo accuracy: before {before:.0%} -> after {after:.0%} ({count} held-out examples, {wall:.0f} s in all)")
    print_report(Path(printer.finished.run_dir), json_lines)
    return 0
