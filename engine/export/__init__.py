"""Taking a fine-tune elsewhere: the adapter, a merged Hugging Face model, or one GGUF file for llama.cpp/Ollama.

``merged`` writes the adapter and merged safetensors exports; ``gguf`` converts the merged model into a single
GGUF file (with the tokenizer and chat template) plus an Ollama Modelfile. ``from engine.export import ...`` is the
public spelling.
"""

from engine.export.gguf import GGUF_QUANTS, ExportProgress, supported_gguf_family
from engine.export.merged import (
    ADAPTER_README,
    DTYPE_ALIASES,
    EXPORT_DTYPES,
    MERGED_README,
    export_adapter,
    export_merged,
    merged_model,
    normalize_dtype,
    run_dtype,
)
from engine.export.to_gguf import export_gguf

__all__ = [
    "ADAPTER_README",
    "DTYPE_ALIASES",
    "EXPORT_DTYPES",
    "GGUF_QUANTS",
    "MERGED_README",
    "ExportProgress",
    "export_adapter",
    "export_gguf",
    "export_merged",
    "merged_model",
    "normalize_dtype",
    "run_dtype",
    "supported_gguf_family",
]
