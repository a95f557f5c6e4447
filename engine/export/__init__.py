"""Taking a fine-tune out of TuneDeck: the adapter as it is, or a merged model (engine.export.merged).

``from engine.export import export_adapter, export_merged`` is the public spelling; each format lives in its own
module of this package.
"""

from engine.export.merged import (
    ADAPTER_README,
    DTYPE_ALIASES,
    EXPORT_DTYPES,
    MERGED_README,
    export_adapter,
    export_merged,
    merged_model,
    normalize_dtype,
)

__all__ = [
    "ADAPTER_README",
    "DTYPE_ALIASES",
    "EXPORT_DTYPES",
    "MERGED_README",
    "export_adapter",
    "export_merged",
    "merged_model",
    "normalize_dtype",
]
