"""``tunedeck train``: fine-tune on a dataset or the built-in demo, with a progress bar or JSON lines.

Ctrl-C asks the run to stop after saving a checkpoint; a second Ctrl-C aborts.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.cli.flags import add_config_flags, config_from_args
from engine.config import RunConfig
from engine.errors import TuneDeckError
from engine.hardware.recipes import AUTOMATIC_RECIPE, RECIPES, Recipe, apply_recipe

EPILOG = """examples:
  tunedeck train --demo                         fine-tune the built-in demo model (CPU, about a minute)
  tunedeck train --model ./my-model --data chats.jsonl --max-steps 200
  tunedeck train --resume runs/20261130-120000-my-model-chats
  tunedeck train --method dpo --model ./my-model --data pairs.jsonl   prefer chosen over rejected answers (DPO)
  tunedeck train --model ./my-model --data chats.jsonl --gpus 2   one process per GPU (torchrun, DDP)
  tunedeck train --model ./my-model --data chats.jsonl --nodes 2 --node-rank 0 --rendezvous 192.168.1.10:29400
                                                one run on two computers: node 1 runs the same with --node-rank 1
"""


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck train",
        description="Fine-tune a LoRA (or QLoRA) adapter. Every run writes a folder with config.json, "
        "metrics.jsonl, checkpoints/ and the final adapter/ in PEFT format. Each setting's flag is its name in "
        "the config (--weight-decay for training.weight_decay); the grouped spelling (--training-weight-decay) "
        "works too.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--demo", action="store_true", help="fine-tune the built-in demo model on the demo task")
    parser.add_argument("--config", metavar="FILE", help="a config.json to start from (flags override it)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its last checkpoint")
    parser.add_argument("--json", action="store_true", help="print events as JSON lines instead of a progress bar")
    parser.add_argument(
        "--last",
        action="store_true",
        help="with --adapter RUN: start from the run's last adapter, not its best one (as chat and export take it)",
    )
    parser.add_argument(
        "--recipe",
        metavar="NAME",
        help="start from a named recipe, as the app's Recipe page offers them (flags override it): "
        + "; ".join(f"'{r.name}'" for r in RECIPES if not r.demo_only)
        + f" (default: {AUTOMATIC_RECIPE}, settings fitted to the data when the run starts)",
    )
    add_config_flags(parser)
    return parser


def train_main(argv: list[str]) -> int:
    from engine.cli.progress import run_with_progress
    from engine.quiet import quiet_libraries

    parser = train_parser()
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        config = train_config(args)
    except TuneDeckError as err:
        print(f"tunedeck train: error: {err}", file=sys.stderr)
        return 2
    if args.demo and not args.resume:
        from engine.cli.demo import run_demo

        return _with_stop_on_interrupt(lambda control: run_demo(config, control, json_lines=args.json))
    return _with_stop_on_interrupt(
        lambda control: run_with_progress(config, control, resume=args.resume, json_lines=args.json)
    )


def train_config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig ``tunedeck train`` runs for these parsed flags (``--config``, ``--resume`` and ``--demo``
    included)."""
    base = RunConfig.load(args.config) if args.config else RunConfig()
    if args.resume and not args.config:  # flags not given (--gpus among them) keep the run's own settings
        base = RunConfig.load(Path(args.resume) / "config.json")
    if args.demo:
        from engine.cli.demo import demo_config

        base = demo_config(base)
    if args.recipe:
        base = apply_recipe(base, _recipe(args.recipe))
    config = config_from_args(args, base)
    if args.last and config.model.adapter is None:
        raise TuneDeckError("--last chooses which of a run's adapters --adapter starts from", hint="pass --adapter RUN")
    if config.model.adapter is not None and not args.resume:
        config = _with_adapter_folder(config, "last" if args.last else "best")
    if not args.resume and not config.data.path:
        raise TuneDeckError("no dataset given", hint="pass --data PATH, or --demo for the built-in demo")
    return config


def _with_adapter_folder(config: RunConfig, which: str) -> RunConfig:
    """``config`` starting from the adapter folder itself, so the run (and its resume) keeps the adapter chosen now
    even if the earlier run goes on and keeps a new best."""
    import dataclasses

    from engine.run.session import starting_adapter_folder

    folder = starting_adapter_folder(config.model.adapter or "", which)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, adapter=str(folder)))


def _recipe(name: str) -> Recipe:
    """The recipe of that name, in any letter case."""
    for recipe in RECIPES:
        if recipe.name.lower() == name.strip().lower():
            return recipe
    raise TuneDeckError(
        f"--recipe: no recipe named {name!r}", hint="recipes: " + ", ".join(f"'{r.name}'" for r in RECIPES)
    )


def _with_stop_on_interrupt(job: Callable[[Any], int]) -> int:
    """Run ``job(control)``; the first Ctrl-C asks the run to stop after saving, the second aborts."""
    from engine.run.control import RunControl

    control = RunControl()

    def on_interrupt(signum: int, frame: Any) -> None:
        if control.stop_requested:
            raise KeyboardInterrupt
        print("\nstopping after this step (saving a checkpoint); press Ctrl-C again to abort", file=sys.stderr)
        control.stop()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        return job(control)
    except KeyboardInterrupt:
        print("aborted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
