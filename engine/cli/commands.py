"""The ``tunedeck`` command line.

``tunedeck train`` flags are generated from the config dataclasses (engine.config), so each setting is defined
once; precedence is defaults < ``--config FILE`` < explicit flags. Other commands live in their own modules and
are imported only when used, so ``tunedeck --help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

from engine.config import RunConfig, coerce_value
from engine.errors import TuneDeckError

VERSION = "0.1.0"

# command -> (module:function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("engine.cli:train_main", "fine-tune a model on a dataset (or the built-in demo)"),
    "bench": ("engine.bench:main", "measure the speed optimizations against stock transformers+PEFT on this GPU"),
    "detect": ("engine.hardware.cli:detect_main", "show the GPU, what TuneDeck will do with it, and why"),
    "plan": ("engine.hardware.cli:plan_main", "will a model fit on a GPU (this or any named one), and how"),
    "runs": ("engine.runs_cli:runs_main", "list, show, rename or delete past runs"),
    "chat": ("engine.runs_cli:chat_main", "chat with a run's fine-tuned model (and the base model beside it)"),
    "export": ("engine.runs_cli:export_main", "export a run's adapter, or a merged model with --merged"),
    "setup": (
        "engine.setup.commands:setup_main",
        "detect the GPU and driver, install the matching torch build, check or repair the environment",
    ),
    "export-wheelhouse": (
        "engine.setup.commands:export_wheelhouse_main",
        "write every wheel this environment uses to a folder, for offline re-installs",
    ),
}

EPILOG = """examples:
  tunedeck train --demo                         fine-tune the built-in demo model (CPU, about a minute)
  tunedeck train --model ./my-model --data chats.jsonl --max-steps 200
  tunedeck train --resume runs/20261130-120000-my-model-chats
  tunedeck train --model ./my-model --data chats.jsonl --gpus 2   one process per GPU (torchrun, DDP)
"""


def _load(target: str) -> Callable[[list[str]], int]:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return _load(COMMANDS[args[0]][0])(args[1:])
    parser = argparse.ArgumentParser(
        prog="tunedeck",
        description="TuneDeck: LoRA/QLoRA fine-tuning of language models on your own NVIDIA GPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tunedeck {VERSION}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    if not args:
        parser.print_help()
        return 0
    parser.parse_args(args)  # unknown commands and --help/--version end here
    return 2


# ---------------------------------------------------------------------------------------------------- train


def _flag(section: str, spec: dataclasses.Field[Any]) -> str:
    return spec.metadata.get("flag") or f"--{section}-{spec.name}".replace("_", "-")


def _dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section, with the field's help text and default."""
    defaults = RunConfig()
    for section in dataclasses.fields(RunConfig):
        group = parser.add_argument_group(f"{section.name} settings")
        section_type = type(getattr(defaults, section.name))
        hints = get_type_hints(section_type)
        for spec in dataclasses.fields(section_type):
            _add_field_flag(
                group, section.name, spec, hints[spec.name], getattr(getattr(defaults, section.name), spec.name)
            )


def _add_field_flag(group: Any, section: str, spec: dataclasses.Field[Any], annotation: Any, default: Any) -> None:
    kwargs: dict[str, Any] = {"dest": _dest(section, spec.name), "default": argparse.SUPPRESS}
    help_text = spec.metadata.get("help", "")
    options = get_args(annotation)
    if annotation is bool or (bool in options and type(None) in options):
        kwargs["action"] = argparse.BooleanOptionalAction
        shown = "auto" if default is None else ("on" if default else "off")
        kwargs["help"] = f"{help_text} (default: {shown})"
    elif getattr(annotation, "__origin__", None) is Literal:
        kwargs["choices"] = options
        kwargs["help"] = f"{help_text} (default: {default})"
    else:
        kwargs["metavar"] = spec.name.upper()
        kwargs["help"] = f"{help_text} (default: {default})"
    group.add_argument(_flag(section, spec), **kwargs)


def config_from_args(args: argparse.Namespace, base: RunConfig) -> RunConfig:
    """Overlay the flags the user gave on ``base``, converting and checking each value."""
    raw = base.to_dict()
    hints = {s.name: get_type_hints(type(getattr(base, s.name))) for s in dataclasses.fields(RunConfig)}
    for dest, value in vars(args).items():
        if not dest.startswith("cfg__"):
            continue
        _, section, name = dest.split("__")
        raw[section][name] = coerce_value(
            f"{section}.{name}", hints[section][name], _parse_flag_value(value, hints[section][name])
        )
    return RunConfig.from_dict(raw)


def _parse_flag_value(value: Any, annotation: Any) -> Any:
    """argparse gives strings; turn them into the field's type before the config checks them."""
    if not isinstance(value, str):
        return value
    options = [opt for opt in (get_args(annotation) or (annotation,)) if opt is not type(None)]
    target = options[0] if len(options) == 1 else annotation
    try:
        if target is int:
            return int(value)
        if target is float:
            return float(value)
    except ValueError:
        return value  # the config check names the field and the bad value
    return value


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck train",
        description="Fine-tune a LoRA (or QLoRA) adapter. Every run writes a folder with config.json, "
        "metrics.jsonl, checkpoints/ and the final adapter/ in PEFT format.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--demo", action="store_true", help="fine-tune the built-in demo model on the demo task")
    parser.add_argument("--config", metavar="FILE", help="a config.json to start from (flags override it)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its last checkpoint")
    parser.add_argument("--json", action="store_true", help="print events as JSON lines instead of a progress bar")
    add_config_flags(parser)
    return parser


def train_main(argv: list[str]) -> int:
    from engine.progress import run_with_progress
    from engine.quiet import quiet_libraries

    parser = train_parser()
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        config = _train_config(args)
    except TuneDeckError as err:
        print(f"tunedeck train: error: {err}", file=sys.stderr)
        return 2
    if args.demo and not args.resume:
        from engine.demo_run import run_demo

        return _with_stop_on_interrupt(lambda control: run_demo(config, control, json_lines=args.json))
    return _with_stop_on_interrupt(
        lambda control: run_with_progress(config, control, resume=args.resume, json_lines=args.json)
    )


def _train_config(args: argparse.Namespace) -> RunConfig:
    base = RunConfig.load(args.config) if args.config else RunConfig()
    if args.resume and not args.config:  # flags not given (--gpus among them) keep the run's own settings
        base = RunConfig.load(Path(args.resume) / "config.json")
    if args.demo:
        from engine.demo_run import demo_config

        base = demo_config(base)
    config = config_from_args(args, base)
    if not args.resume and not config.data.path:
        raise TuneDeckError("no dataset given", hint="pass --data PATH, or --demo for the built-in demo")
    return config


def _with_stop_on_interrupt(job: Callable[[Any], int]) -> int:
    """Run ``job(control)``; the first Ctrl-C asks the run to stop after saving, the second aborts."""
    from engine.control import RunControl

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


if __name__ == "__main__":
    sys.exit(main())
