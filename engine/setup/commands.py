"""``tunedeck setup ...`` and ``tunedeck export-wheelhouse``: the setup jobs from a terminal.

The installers call these through ``python -m engine.setup`` (which works before the CLI knows them); the app's
setup view calls the same generators directly.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.setup.cancel import CancelToken
from engine.setup.events import (
    OutputLine,
    Progress,
    SetupCancelled,
    SetupEvent,
    SetupFailed,
    SetupFinished,
    SetupWarning,
    StepStarted,
)
from engine.setup.torch_build import BUILDS, TorchChoice, choose_torch_build, describe, detect_driver


def _print_events(events: Iterable[SetupEvent], json_lines: bool) -> int:
    """Print events as they come; 0 when the job finished, 1 when it failed, 130 when cancelled."""
    code = 1
    last_percent = -1
    for event in events:
        if json_lines:
            print(json.dumps(event.to_dict()), flush=True)
        elif isinstance(event, StepStarted):
            print(f"[{event.index}/{event.total}] {event.title}", flush=True)
        elif isinstance(event, Progress) and event.total:
            percent = 100 * event.done // event.total
            if percent != last_percent:
                last_percent = percent
                print(f"    {event.done}/{event.total} {event.item} ({percent}%)", flush=True)
        elif isinstance(event, OutputLine):
            print(f"    {event.text}", flush=True)
        elif isinstance(event, SetupWarning):
            print(f"warning: {event.text}", file=sys.stderr)
        elif isinstance(event, SetupFailed):
            print(f"error: {event.message}" + (f"\n{event.hint}" if event.hint else ""), file=sys.stderr)
        elif isinstance(event, SetupCancelled):
            print(event.message, file=sys.stderr)
            code = 130
        if isinstance(event, SetupFinished):
            if not json_lines:
                print(event.summary)
            code = 0
    return code


def _with_cancel_on_interrupt(job: Any) -> int:
    cancel = CancelToken()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.cancel())
    try:
        return int(job(cancel))
    finally:
        signal.signal(signal.SIGINT, previous)


def _layout(root: str | None) -> Any:
    from engine.setup.environment import InstallLayout, current_layout

    if root:
        return InstallLayout(Path(root).resolve())
    layout = current_layout()
    if layout is None:
        raise SystemExit("tunedeck setup: this Python is not an installed TuneDeck; pass --root FOLDER")
    return layout


def _choice(build: str | None) -> TorchChoice:
    return choose_torch_build(detect_driver(), build)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck setup", description="Set up, check or repair TuneDeck's environment."
    )
    jobs = parser.add_subparsers(dest="job", required=True, metavar="JOB")
    detect = jobs.add_parser("detect", help="show the GPU, the driver and the torch build that fits them")
    detect.add_argument("--build", choices=BUILDS, help="use this torch build instead of the automatic choice")
    detect.add_argument("--json", action="store_true", help="print JSON")
    for name, text in (("install-torch", "install the torch build for this GPU (first-run setup)"),
                       ("repair", "rebuild the environment from scratch and swap it in when it works")):  # fmt: skip
        job = jobs.add_parser(name, help=text)
        job.add_argument("--build", choices=BUILDS, help="use this torch build instead of the automatic choice")
        job.add_argument("--wheelhouse", metavar="FOLDER", help="install from an exported wheelhouse, with no network")
        job.add_argument("--root", metavar="FOLDER", help="the installation folder (default: the running one)")
        job.add_argument("--json", action="store_true", help="print events as JSON lines")
        if name == "repair":
            job.add_argument("--python", help="Python version or interpreter for the new environment")
    check = jobs.add_parser("check", help="check that the environment and torch load")
    finish = jobs.add_parser("finish-repair", help="swap in a repaired environment that is waiting")
    for job in (check, finish):
        job.add_argument("--root", metavar="FOLDER", help="the installation folder (default: the running one)")
    return parser


def setup_main(argv: list[str] | None = None) -> int:
    """``tunedeck setup JOB``."""
    from engine.setup import environment

    args = setup_parser().parse_args(argv)
    if args.job == "detect":
        driver = detect_driver()
        choice = choose_torch_build(driver, args.build)
        if args.json:
            print(json.dumps({"driver": _plain(driver), "choice": {**_plain(choice), "index_url": choice.index_url}}))
        else:
            print("\n".join(describe(driver, choice)))
        return 0 if choice.blocked is None else 3
    layout = _layout(args.root)
    if args.job == "check":
        health = environment.check_environment(layout)
        print(health.summary if health.ok else "\n".join(health.problems))
        return 0 if health.ok else 1
    if args.job == "finish-repair":
        return 0 if environment.finish_pending_repair(layout) else 1
    wheelhouse = Path(args.wheelhouse).resolve() if args.wheelhouse else None
    choice = _choice(args.build)
    if not args.json:
        print(f"torch build: {choice.build} ({choice.reason})")
    if args.job == "install-torch":
        return _with_cancel_on_interrupt(
            lambda cancel: _print_events(environment.install_torch(layout, choice, wheelhouse, cancel), args.json)
        )
    return _with_cancel_on_interrupt(
        lambda cancel: _print_events(environment.repair(layout, choice, wheelhouse, args.python, cancel), args.json)
    )


def _plain(value: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(value)


def export_wheelhouse_main(argv: list[str] | None = None) -> int:
    """``tunedeck export-wheelhouse FOLDER``: every wheel this environment uses, for an offline re-install."""
    from engine.setup.wheelhouse import export_wheelhouse

    parser = argparse.ArgumentParser(
        prog="tunedeck export-wheelhouse",
        description="Write every wheel this environment uses (torch included) to FOLDER. Install from it later with "
        "no network: put it beside the installer as 'wheelhouse', or run 'tunedeck setup repair --wheelhouse FOLDER'.",
    )
    parser.add_argument("folder", help="where to write the wheels (created if missing)")
    parser.add_argument("--search", action="append", default=[], metavar="FOLDER",
                        help="take wheels from this folder instead of rebuilding them (repeatable)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print events as JSON lines")
    args = parser.parse_args(argv)
    search = [Path(p) for p in args.search]
    return _with_cancel_on_interrupt(
        lambda cancel: _print_events(export_wheelhouse(Path(args.folder), search=search, cancel=cancel), args.json)
    )
