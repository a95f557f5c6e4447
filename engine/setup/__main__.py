"""``python -m engine.setup JOB``: the setup jobs, callable by the installers before the CLI is wired."""

from __future__ import annotations

import sys

from engine.setup.commands import export_wheelhouse_main, setup_main

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["export-wheelhouse"]:
        sys.exit(export_wheelhouse_main(args[1:]))
    sys.exit(setup_main(args))
