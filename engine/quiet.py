"""Keeping library chatter out of a user's terminal (progress bars of weight loading, deprecation notes)."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Silence the informational output of transformers, datasets and bitsandbytes; errors still show."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient checkpointing.*")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except ImportError:
        pass
