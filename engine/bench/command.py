"""``tunedeck bench``: the 16-bit rows (:mod:`engine.bench.speed`) or, by its first flag, another benchmark.

``--app-path`` (:mod:`engine.bench.app_path`), ``--qlora`` (:mod:`engine.bench.qlora`), ``--long-context``
(:mod:`engine.bench.long_context`), ``--dpo`` (:mod:`engine.bench.dpo`; ``tunedeck bench dpo`` too) and ``--grpo``
(:mod:`engine.bench.grpo`) each take their
own options; the modules they name import the 16-bit bench's helpers, never the other way round.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from engine.hardware.allocator import set_at_process_start


def _app_path(argv: list[str]) -> int:
    from engine.bench.app_path import main

    return main(argv)


def _qlora(argv: list[str]) -> int:
    from engine.bench.qlora import main

    return main(argv)


def _long_context(argv: list[str]) -> int:
    from engine.bench.long_context import main

    return main(argv)


def _dpo(argv: list[str]) -> int:
    from engine.bench.dpo import main

    return main(argv)


def _grpo(argv: list[str]) -> int:
    from engine.bench.grpo import main

    return main(argv)


MODES: dict[str, Callable[[list[str]], int]] = {
    "--app-path": _app_path,
    "--qlora": _qlora,
    "--long-context": _long_context,
    "--dpo": _dpo,
    "--grpo": _grpo,
}
"""A flag that picks another benchmark, and how it is run with the rest of the arguments."""


def main(argv: list[str] | None = None) -> int:
    set_at_process_start()  # as the app and the CLI do: the bench measures what users get
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and f"--{argv[0]}" in MODES:  # a benchmark named as a word: ``tunedeck bench dpo``
        argv = [f"--{argv[0]}", *argv[1:]]
    for flag, run in MODES.items():
        if flag in argv:
            return run([arg for arg in argv if arg != flag])
    from engine.bench.speed import main as speed_main

    return speed_main(argv)
