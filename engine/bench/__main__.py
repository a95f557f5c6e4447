"""``python -m engine.bench``: the benchmarks (engine.bench.command), as ``tunedeck bench``."""

from __future__ import annotations

import sys

from engine.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
