"""``python -m engine.bench``: the speed benchmark (engine.bench.speed), as ``tunedeck bench``."""

from __future__ import annotations

import sys

from engine.bench.speed import main

if __name__ == "__main__":
    sys.exit(main())
