"""``tunedeck chat RUN --image PICTURE``: ask a vision-language run's fine-tune (and its base model) about a picture.

Replies are greedy (the same every time), so the tuned and base answers differ only by the adapter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.errors import TuneDeckError


def is_image_run(folder: Path) -> bool:
    """Whether the run trained a vision-language model (its base model's config has a vision tower)."""
    from engine.vision.export import run_vision_family

    return run_vision_family(folder) is not None


def image_chat_main(args: argparse.Namespace, folder: Path) -> int:
    """Answer ``args.prompt`` (or each prompt typed) about ``args.image`` as the tuned model, and as the base model
    with ``args.base``."""
    from engine.quiet import quiet_libraries
    from engine.vision.chat import ask, load_image_chat

    quiet_libraries()
    try:
        chat = load_image_chat(folder, device=args.device, which="last" if args.last else "best")
    except TuneDeckError as err:
        print(f"tunedeck chat: error: {err}", file=sys.stderr)
        return 1
    print(f"tuned: {chat.adapter.describe()} of {chat.label}", file=sys.stderr)
    prompts = [args.prompt] if args.prompt is not None else iter(_read_prompt, None)
    try:
        for prompt in prompts:
            print(f"tuned> {ask(chat, prompt, args.image, True, args.max_tokens)}", flush=True)
            if args.base:
                print(f"base>  {ask(chat, prompt, args.image, False, args.max_tokens)}", flush=True)
    except TuneDeckError as err:
        print(f"tunedeck chat: error: {err}", file=sys.stderr)
        return 1
    return 0


def _read_prompt() -> str | None:
    try:
        return input("you> ").strip() or None
    except EOFError:
        return None
