"""The ``tunedeck`` command line: :func:`main` dispatches a command word to its module.

- engine.cli.commands: the command table, ``--help`` and ``--version``;
- engine.cli.train, engine.cli.flags: ``tunedeck train`` and its flags, generated from the config tree;
- engine.cli.progress: the progress bar (or JSON lines) while a run trains;
- engine.cli.runs: ``tunedeck runs``, ``chat`` and ``export``;
- engine.cli.demo: ``tunedeck train --demo``, with its accuracy before and after.

``detect``, ``plan`` and ``setup`` live beside what they show (engine.hardware.cli, engine.setup.commands; ``plan``
adds the pictures of a vision-language model in engine.cli.plan).
"""

from engine.cli.commands import main

__all__ = ["main"]
