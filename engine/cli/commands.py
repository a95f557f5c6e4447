"""The ``tunedeck`` command line: one word per command, each handled by its own module.

A command's module is imported only when that command runs, so ``tunedeck --help`` answers at once and never
loads torch. ``tunedeck train`` lives in engine.cli.train, its flags in engine.cli.flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from engine.cli.train import EPILOG
from engine.hardware.allocator import set_at_process_start

VERSION = "0.1.0"

# command -> (module:function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("engine.cli.train:train_main", "fine-tune a model on a dataset (or the built-in demo)"),
    "bench": ("engine.bench.command:main", "measure the speed switches against stock transformers+PEFT on this GPU"),
    "detect": ("engine.hardware.cli:detect_main", "show the GPU, what TuneDeck will do with it, and why"),
    "plan": ("engine.cli.plan:plan_main", "will a model fit on a GPU (this or any named one), and how"),
    "models": (
        "engine.cli.models:models_main",
        "the GGUF models in Ollama and LM Studio to train from",
    ),
    "runs": ("engine.cli.runs:runs_main", "list, show, rename or delete past runs"),
    "chat": ("engine.cli.runs:chat_main", "chat with a run's fine-tuned model (and the base model beside it)"),
    "export": ("engine.cli.runs:export_main", "export a run's adapter, or a merged model with --merged"),
    "report": ("engine.cli.runs:report_main", "base vs tuned on held-out data, and what it forgot"),
    "preferences": (
        "engine.cli.preferences:preferences_main",
        "the better answers picked in the app's chat: list, export as DPO data, or train on them",
    ),
    "setup": (
        "engine.setup.commands:setup_main",
        "detect the GPU and driver, install the matching torch build, check or repair the environment",
    ),
    "export-wheelhouse": (
        "engine.setup.commands:export_wheelhouse_main",
        "write every wheel this environment uses to a folder, for offline re-installs",
    ),
}


TORCH_MISSING_EXIT = 3
"""Exit status of a command that needs torch when torch is not installed."""


def _load(target: str) -> Callable[[list[str]], int]:
    module, function = target.split(":")
    command: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    return command


def run_command(name: str, argv: list[str]) -> int:
    """Run one command; one that needs torch where torch is missing says how to install it instead of failing."""
    try:
        return _load(COMMANDS[name][0])(argv)
    except ModuleNotFoundError as err:
        if err.name != "torch" and not (err.name or "").startswith("torch."):
            raise
        detail = "" if err.name == "torch" else f" (or incomplete: {err})"
        print(
            f"tunedeck {name}: torch is not installed{detail}, and this command needs it.\n"
            "Install the torch build that fits this machine's GPU with `tunedeck setup install-torch`, "
            "or open the TuneDeck app, which offers to install it.",
            file=sys.stderr,
        )
        return TORCH_MISSING_EXIT


def main(argv: Sequence[str] | None = None) -> int:
    set_at_process_start()  # before any command can start CUDA
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return run_command(args[0], args[1:])
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


if __name__ == "__main__":
    sys.exit(main())
