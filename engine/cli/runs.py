"""``tunedeck runs``, ``tunedeck chat``, ``tunedeck export`` and ``tunedeck report``: past runs from the terminal.

RUN is a run folder or a run in the registry (its id, a unique id prefix, or its name). A folder works even when
the registry has never seen it (a run copied from another machine), so chat and export need only the folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from engine.errors import TuneDeckError
from engine.run.registry import Registry, RunRecord
from engine.run.summary import describe, summary_of_record

if TYPE_CHECKING:
    from engine.export import ExportProgress
    from engine.model.chat import ChatModel, GenerationSettings


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _date(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def run_folder(ref: str, registry: Registry | None = None) -> Path:
    """The folder of RUN: a path to a run folder, or a registry id/name."""
    path = Path(ref).expanduser()
    if (path / "config.json").exists():
        return path
    return Path((registry or Registry()).resolve(ref).folder)


def print_table(records: list[RunRecord], out: TextIO) -> None:
    """One line a run; speed, peak and status worded as the app's pages word them (engine.run.summary)."""
    header = ("ID", "NAME", "MODEL", "DATASET", "DATE", "STEPS", "LOSS", "SPEED (MEAN)", "PEAK (MEASURED)", "STATUS")
    rows = []
    for r in records:
        texts = describe(summary_of_record(r))
        rows.append((r.id, r.name, Path(r.model).name or r.model, Path(r.dataset).name, _date(r.created),
                     f"{r.steps}/{r.total_steps}", _fmt(r.final_loss), texts.speed or "-", texts.peak or "-",
                     texts.state))  # fmt: skip
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out)


def print_record(record: RunRecord, out: TextIO) -> None:
    texts = describe(summary_of_record(record))
    resume = f" (resume with: tunedeck train --resume {record.folder})" if record.resumable else ""
    lines = [
        f"id:          {record.id}",
        f"name:        {record.name}",
        f"status:      {texts.state.removesuffix(' (resumable)')}{resume}",
        f"folder:      {record.folder}",
        f"model:       {record.model}",
        f"dataset:     {record.dataset}",
        f"created:     {_date(record.created)}   updated: {_date(record.updated)}",
        f"steps:       {record.steps} of {record.total_steps}",
        f"final loss:  {_fmt(record.final_loss)}   eval loss: {_fmt(record.eval_loss)}",
        f"tokens/s:    {texts.speed.removesuffix(' tokens/s') or '-'} (mean over its steps)",
        f"peak memory: measured {texts.peak or '-'}",
        f"hardware:    {json.dumps(record.hardware)}",
        f"speed:       {json.dumps(record.speed)}",
    ]
    if record.message:
        lines.append(f"message:     {record.message}")
    print("\n".join(lines), file=out)


def runs_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck runs", description="List, inspect, rename and delete past runs (the run history)."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="every run, newest first (the default)")
    show = actions.add_parser("show", help="everything recorded about one run")
    show.add_argument("run", metavar="RUN", help="run id, name or folder")
    show.add_argument("--json", action="store_true", help="print the record as JSON")
    rename = actions.add_parser("rename", help="give a run a new name (its folder keeps its own)")
    rename.add_argument("run", metavar="RUN")
    rename.add_argument("name", metavar="NAME", help="one plain folder name, as for tunedeck train --name")
    delete = actions.add_parser(
        "delete",
        help="delete a run's record and what TuneDeck wrote in its folder; files TuneDeck did not write stay, and "
        "so does the folder then",
    )
    delete.add_argument("run", metavar="RUN")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    delete.add_argument("--keep-folder", action="store_true", help="only forget the record")
    return parser


def runs_main(argv: list[str]) -> int:
    args = runs_parser().parse_args(argv)
    try:
        registry = Registry()
        if args.action in (None, "list"):
            records = registry.runs()
            if not records:
                print("no runs yet: start one with tunedeck train --demo")
                return 0
            print_table(records, sys.stdout)
            return 0
        record = registry.resolve(args.run)
        if args.action == "show":
            if args.json:
                print(json.dumps({k: v for k, v in vars(record).items() if k != "stored_status"}, indent=2))
            else:
                print_record(record, sys.stdout)
        elif args.action == "rename":
            registry.rename(record.id, args.name)
            print(f"renamed {record.id} to {args.name.strip()}")
        elif args.action == "delete":
            return _delete(registry, record, args.yes, args.keep_folder)
        return 0
    except TuneDeckError as err:
        print(f"tunedeck runs: error: {err}", file=sys.stderr)
        return 1


def _delete(registry: Registry, record: RunRecord, yes: bool, keep_folder: bool) -> int:
    what = "the record" if keep_folder else f"the record and TuneDeck's files in {record.folder}"
    if not yes:
        answer = input(f"delete run {record.name} ({record.id}): {what}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    removal = registry.delete(record.id, remove_folder=not keep_folder)
    print(f"deleted the record of {record.name} ({record.id})")
    if removal is not None:
        print("\n".join(removal.lines()))
    elif not keep_folder:
        print(f"its folder {record.folder} was already gone")
    return 0


# ------------------------------------------------------------------------------------------------------ chat


def chat_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck chat",
        description="Chat with a fine-tuned model: the run's adapter on its base model. Interactive unless "
        "--prompt is given; an empty line or Ctrl-D ends the chat, Ctrl-C stops a reply.",
    )
    parser.add_argument("run", metavar="RUN", help="run id, name or folder")
    parser.add_argument("--prompt", help="answer this one prompt and exit")
    parser.add_argument("--base", action="store_true", help="also answer as the base model, to compare")
    parser.add_argument(
        "--last",
        action="store_true",
        help="chat with the adapter the run ended with, not its best one (the lowest held-out loss; the default)",
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy decoding (default: 0.7)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default: 0.9)")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest reply in tokens (default: 256)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--image", metavar="PICTURE", help="a vision-language run: ask about this picture")
    return parser


def _answer(chat: ChatModel, messages: list[dict[str, str]], settings: GenerationSettings, use_adapter: bool) -> str:
    import threading

    from engine.model.chat import stream_reply

    stop = threading.Event()
    pieces: list[str] = []
    try:
        for piece in stream_reply(chat, messages, settings, use_adapter=use_adapter, stop=stop):
            pieces.append(piece)
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        stop.set()
        print(" [stopped]", end="")
    print()
    return "".join(pieces)


def chat_main(argv: list[str]) -> int:
    args = chat_parser().parse_args(argv)
    from engine.cli.image_chat import image_chat_main, is_image_run
    from engine.model.chat import GenerationSettings, load_chat_model
    from engine.quiet import quiet_libraries

    try:
        folder = run_folder(args.run)
    except TuneDeckError as err:
        print(f"tunedeck chat: error: {err}", file=sys.stderr)
        return 1
    if is_image_run(folder):  # a vision-language run: its answers about a picture (engine.cli.image_chat)
        return image_chat_main(args, folder)
    if args.image:
        print("tunedeck chat: error: --image needs a run of a vision-language model", file=sys.stderr)
        return 1

    quiet_libraries()
    try:
        settings = GenerationSettings(args.temperature, args.top_p, args.max_tokens)
        chat = load_chat_model(run_folder(args.run), device=args.device, adapter="last" if args.last else "best")
    except TuneDeckError as err:
        print(f"tunedeck chat: error: {err}", file=sys.stderr)
        return 1
    if chat.adapter is not None:
        print(f"tuned: {chat.adapter.describe()} of {chat.label}", file=sys.stderr)
    tuned: list[dict[str, str]] = []
    base: list[dict[str, str]] = []
    prompts: Iterator[str | None] = iter([args.prompt]) if args.prompt is not None else iter(_read_prompt, None)
    for text in prompts:
        if not text:
            break
        tuned.append({"role": "user", "content": text})
        print("tuned> ", end="", flush=True)
        tuned.append({"role": "assistant", "content": _answer(chat, tuned, settings, True)})
        if args.base:
            base.append({"role": "user", "content": text})
            print("base>  ", end="", flush=True)
            base.append({"role": "assistant", "content": _answer(chat, base, settings, False)})
    return 0


def _read_prompt() -> str | None:
    try:
        return input("you> ").strip() or None
    except EOFError:
        return None


# ---------------------------------------------------------------------------------------------------- export


def export_parser() -> argparse.ArgumentParser:
    from engine.export import GGUF_QUANTS

    parser = argparse.ArgumentParser(
        prog="tunedeck export",
        description="Export a run's adapter (PEFT format); with --merged a full model with the adapter folded "
        "into its weights (safetensors) that loads without peft; with --gguf the merged model as one GGUF file "
        "with a Modelfile, for llama.cpp, Ollama and LM Studio. The folder gets a README on how to load it.",
    )
    parser.add_argument("run", metavar="RUN", help="run id, name or folder")
    parser.add_argument("--to", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument("--merged", action="store_true", help="write a merged model instead of the adapter")
    parser.add_argument(
        "--dtype",
        default=None,
        help="with --merged, the merged model's dtype: bfloat16 (bf16), float16 (fp16) or float32 (fp32); by default "
        "the dtype the run computed in (a float32 run stays float32)",
    )
    parser.add_argument(
        "--gguf",
        nargs="?",
        const="q8_0",
        metavar="QUANT",
        help=f"write a GGUF file and an Ollama Modelfile; QUANT is one of {', '.join(GGUF_QUANTS)} (default q8_0; "
        "the k-quants need llama-cpp-python)",
    )
    parser.add_argument(
        "--install",
        action="append",
        choices=("ollama", "lmstudio"),
        help="with --gguf, install the file into Ollama (ollama create, or its local API) or LM Studio (its models "
        "folder), then ask the installed model --question beside TuneDeck's own answer when the runtime runs; "
        "may be given twice",
    )
    parser.add_argument(
        "--question", default=None, metavar="TEXT", help="with --install, the question to ask the installed model"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    parser.add_argument(
        "--last",
        action="store_true",
        help="export the adapter the run ended with instead of its best one (the lowest held-out loss; the "
        "default where the run held examples out)",
    )
    return parser


def _refused_flags(args: argparse.Namespace) -> str | None:
    """Why a flag given does not apply to this export, or None when every flag applies."""
    if args.gguf and args.merged:
        return "choose one of --merged and --gguf"
    if args.dtype is not None and args.gguf:
        return (
            f"--dtype applies to --merged only: a GGUF file's tensor types come from its QUANT (--gguf {args.gguf}); "
            "for float32 tensors use --gguf f32"
        )
    if args.dtype is not None and not args.merged:
        return "--dtype applies to --merged only: the adapter is exported as it was trained"
    if args.install and not args.gguf:
        return "--install needs a GGUF export (--gguf): Ollama and LM Studio load GGUF files"
    if args.question is not None and not args.install:
        return "--question is asked of an installed model: add --install ollama or --install lmstudio"
    return None


class _ExportPrinter:
    """Export progress on stderr: a line per stage, with a counter that rewrites itself on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.stage = stream, ""
        self.live = stream.isatty()

    def __call__(self, progress: ExportProgress) -> None:
        if progress.stage != self.stage:
            if self.live and self.stage:
                self.stream.write("\n")
            self.stage = progress.stage
            note = progress.message if progress.total <= 1 else f"{progress.total} steps"
            self.stream.write(f"{progress.stage}: {note}" + ("" if self.live else "\n"))
        elif self.live and progress.total > 1:
            self.stream.write(f"\r{progress.stage}: {progress.done}/{progress.total} {progress.message[:60]:<60}")
        elif progress.total <= 1 and progress.message:  # a stage's outcome (llama.cpp's fallback, in one line)
            self.stream.write(
                f"\n{progress.stage}: {progress.message}" if self.live else f"{progress.stage}: {progress.message}\n"
            )
        if progress.stage == "writing" and progress.done == progress.total:
            self.stream.write("\n" if self.live else "")
        self.stream.flush()


def export_main(argv: list[str]) -> int:
    from engine.export import export_adapter, export_gguf, export_merged, normalize_dtype
    from engine.model.adapter import run_adapter
    from engine.quiet import quiet_libraries

    args = export_parser().parse_args(argv)
    refused = _refused_flags(args)
    if refused is not None:
        export_parser().error(refused)
    quiet_libraries()
    which = "last" if args.last else "best"
    try:
        folder = run_folder(args.run)
        chosen = run_adapter(folder, which)
        if args.gguf:
            printer = _ExportPrinter(sys.stderr)
            target = export_gguf(
                folder, args.to, quant=args.gguf, overwrite=args.overwrite, on_progress=printer, adapter=which
            )
        elif args.merged:
            dtype = normalize_dtype(args.dtype) if args.dtype else None
            target = export_merged(folder, args.to, dtype=dtype, overwrite=args.overwrite, adapter=which)
        else:
            target = export_adapter(folder, args.to, overwrite=args.overwrite, adapter=which)
    except TuneDeckError as err:
        print(f"tunedeck export: error: {err}", file=sys.stderr)
        return 1
    what = f"GGUF model ({args.gguf}) and Modelfile" if args.gguf else "merged model" if args.merged else "adapter"
    source = f"; its weights are {chosen.describe()}" if chosen is not None else ""
    print(f"{what} written to {target} (see README.md there){source}")
    if args.gguf:
        _print_tensor_types(target)
    return _install(folder, target, args, which) if args.install else 0


def _print_tensor_types(target: Path) -> None:
    from engine.export.gguf_types import tensor_types
    from engine.export.install import read_export

    types = tensor_types(read_export(target).gguf)
    print(f"tensor types: {types.summary()}")
    advice = types.suggestion()
    if advice:
        print(f"note: {advice}")


def _install(run: Path, target: Path, args: argparse.Namespace, adapter: str) -> int:
    """Install the export into each runtime asked for; 1 when one of them could not be installed."""
    from engine.export.install import DEFAULT_QUESTION, install_export

    status = 0
    for runtime in dict.fromkeys(args.install):
        try:
            report = install_export(run, target, runtime, question=args.question or DEFAULT_QUESTION, adapter=adapter)
        except TuneDeckError as err:
            print(f"tunedeck export: error: {err}", file=sys.stderr)
            status = 1
            continue
        print("\n".join(report.lines()))
        status = status or (0 if report.installed else 1)
    return status


# ---------------------------------------------------------------------------------------------------- report


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunedeck report",
        description="Before and after: the base model and the run's adapters (best and last) side by side on the "
        "run's held-out examples (loss and perplexity; exact match and token F1 of up to 30 answers of at most 32 "
        "tokens, answered greedily; DPO: the held-out pairs' loss and reward accuracy), and the perplexity of a "
        "fixed public-domain English text, to see what the fine-tune forgot. Written to report.md and report.json "
        "in the run folder when a run ends (by tunedeck train or the app); printed from there, or measured now if "
        "it has none.",
    )
    parser.add_argument("run", metavar="RUN", help="run id, name or folder")
    parser.add_argument("--again", action="store_true", help="measure again even if the run has a report")
    parser.add_argument("--json", action="store_true", help="print report.json instead of the Markdown table")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's own)")
    return parser


def report_main(argv: list[str]) -> int:
    from engine.quiet import quiet_libraries
    from engine.run.report import build_report, read_report, write_report

    args = report_parser().parse_args(argv)
    quiet_libraries()
    try:
        folder = run_folder(args.run)
        report = None if args.again else read_report(folder)
        if report is None:
            print(f"measuring the base model and the adapters of {folder.name}...", file=sys.stderr)
            report = build_report(folder, device=args.device)
            write_report(folder, report)
    except TuneDeckError as err:
        print(f"tunedeck report: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.markdown(), end="" if not args.json else "\n")
    return 0
