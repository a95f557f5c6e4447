"""``tunedeck preferences``: the answer pairs saved from the app's chat, listed, exported as DPO data, or trained on.

Pairs are kept per base model (engine.data.preferences); ``--model`` names the base model, ``--run`` a run whose
base model is meant.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from engine.data.preferences import PreferenceStore, saved_models
from engine.errors import TuneDeckError


def preferences_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck preferences",
        description="The preference pairs saved in the app's chat (the better of two answers, kept per base model): "
        "list them, export them as DPO data (prompt/chosen/rejected JSONL for tunedeck train --method dpo), take one "
        "out, or train on them from a run's adapter.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="the models with saved pairs (the default), or one model's pairs")
    _add_model_choice(listing, required=False)
    export = actions.add_parser("export", help="write one model's pairs as DPO data (JSONL)")
    _add_model_choice(export, required=True)
    export.add_argument("--to", required=True, metavar="FILE", help="the .jsonl file to write")
    remove = actions.add_parser("remove", help="take one pair out (its ID from list)")
    _add_model_choice(remove, required=True)
    remove.add_argument("id", metavar="ID")
    train = actions.add_parser("train", help="a DPO run on the pairs of a run's base model, from the run's adapter")
    train.add_argument("run", metavar="RUN", help="run id, name or folder")
    train.add_argument("--last", action="store_true", help="start from the run's last adapter, not its best one")
    train.add_argument("--json", action="store_true", help="print events as JSON lines instead of a progress bar")
    return parser


def _add_model_choice(parser: argparse.ArgumentParser, *, required: bool) -> None:
    choice = parser.add_mutually_exclusive_group(required=required)
    choice.add_argument("--model", metavar="MODEL", help="the base model ('demo', a folder or a hub id)")
    choice.add_argument("--run", metavar="RUN", help="a run (id, name or folder): its base model")


def _store(args: argparse.Namespace) -> PreferenceStore:
    if args.run is not None:
        from engine.cli.runs import run_folder

        return PreferenceStore.for_run(run_folder(args.run))
    return PreferenceStore(args.model)


def preferences_main(argv: list[str]) -> int:
    args = preferences_parser().parse_args(argv)
    try:
        if args.action == "train":
            return _train(args)
        if (
            args.action in (None, "list")
            and getattr(args, "model", None) is None
            and getattr(args, "run", None) is None
        ):
            return _list_models()
        store = _store(args)
        if args.action == "export":
            count = store.export(args.to)
            print(
                f"{count} pairs of {store.label} written to {args.to} (train: tunedeck train --method dpo --data ...)"
            )
        elif args.action == "remove":
            if not store.remove(args.id):
                print(f"tunedeck preferences: error: no pair {args.id} saved for {store.label}", file=sys.stderr)
                return 1
            print(f"removed pair {args.id}; {store.count()} left for {store.label}")
        else:
            _list_pairs(store)
        return 0
    except TuneDeckError as err:
        print(f"tunedeck preferences: error: {err}", file=sys.stderr)
        return 1


def _list_models() -> int:
    models = saved_models()
    if not models:
        print("no preferences saved yet: pick the better of two answers on the app's Chat page")
    for model, count in models:
        print(f"{count:>5}  {model}")
    return 0


def _list_pairs(store: PreferenceStore) -> None:
    stored = store.read()
    for notice in stored.skipped:
        print(f"note: {notice}", file=sys.stderr)
    print(f"{len(stored.pairs)} pairs saved for {store.model} ({store.path})")
    for pair in stored.pairs:
        when = dt.datetime.fromtimestamp(pair.created).strftime("%Y-%m-%d %H:%M")
        prompt = " ".join(pair.prompt[-1]["content"].split())[:60]
        edited = ", edited" if pair.edited else ""
        print(f"{pair.id}  {when}  {pair.chosen_by} over {pair.rejected_by}{edited}  {prompt}")


def _train(args: argparse.Namespace) -> int:
    from engine.cli.progress import run_with_progress
    from engine.cli.runs import run_folder
    from engine.cli.train import _with_stop_on_interrupt
    from engine.quiet import quiet_libraries
    from engine.run.preference_run import train_on_preferences

    quiet_libraries()
    config = train_on_preferences(run_folder(args.run), "last" if args.last else "best")
    return _with_stop_on_interrupt(
        lambda control: run_with_progress(config, control, resume=None, json_lines=args.json)
    )
