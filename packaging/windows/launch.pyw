"""Start TuneDeck on Windows without a console window.

The shortcuts run this file with the base Python's pythonw.exe, outside the environment, so that a repaired
environment waiting in env.new can replace env (Windows keeps a running environment's files locked). Standard
library only: it must work even when env is broken.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ENV, STAGING, OLD = ROOT / "env", ROOT / "env.new", ROOT / "env.old"


def swap_in_repaired_environment() -> None:
    if not (STAGING / ".tunedeck-ready").is_file():
        return
    shutil.rmtree(OLD, ignore_errors=True)
    try:
        if ENV.exists():
            ENV.rename(OLD)
        STAGING.rename(ENV)
    except OSError:
        if not ENV.exists() and OLD.exists():
            OLD.rename(ENV)
        return
    shutil.rmtree(OLD, ignore_errors=True)


def main() -> int:
    swap_in_repaired_environment()
    env = dict(os.environ)
    for name, folder in (("HF_HOME", "huggingface"), ("TORCH_HOME", "torch"), ("TRITON_CACHE_DIR", "triton"),
                         ("PIP_CACHE_DIR", "pip"), ("UV_CACHE_DIR", "uv")):  # fmt: skip
        env.setdefault(name, str(ROOT / "cache" / folder))
    env.pop("VIRTUAL_ENV", None)
    python = ENV / "Scripts" / "pythonw.exe"
    subprocess.Popen([str(python), "-m", "app", *sys.argv[1:]], env=env, cwd=str(ROOT), close_fds=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
