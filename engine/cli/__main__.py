"""``python -m engine.cli``: the ``tunedeck`` command line without the app."""

from __future__ import annotations

import sys

from engine.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
