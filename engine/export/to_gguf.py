"""GGUF export of any run: a text model as one file (engine.export.gguf), a vision-language model as the language
model and its vision projector file (engine.export.vision_gguf)."""

from __future__ import annotations

from pathlib import Path

from engine.export.gguf import LLAMA_CPP_QUANTS, ProgressCallback, _llama_cpp, export_text_gguf, normalize_quant


def export_gguf(
    run_folder: str | Path,
    target: str | Path,
    *,
    quant: str = "q8_0",
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
    adapter: str = "best",
) -> Path:
    """Write the run's model merged with ``adapter`` (best or last) to ``target`` as ``<name>.gguf`` (and, for a
    vision-language model, ``mmproj-<name>.gguf``) with a README; returns ``target``.

    Raises TuneDeckError for an unknown quantization, a family GGUF export does not support, a k-quant without
    llama-cpp-python, or a target folder that is not empty (unless ``overwrite``).
    """
    from engine.vision.export import run_vision_family

    family = run_vision_family(Path(run_folder))
    if family is None:
        return export_text_gguf(run_folder, target, quant=quant, overwrite=overwrite, on_progress=on_progress,
                                adapter=adapter)  # fmt: skip
    quant = normalize_quant(quant)
    if quant in LLAMA_CPP_QUANTS:
        _llama_cpp()
    from engine.export.vision_gguf import export_vision_gguf

    report = on_progress or (lambda _: None)
    return export_vision_gguf(Path(run_folder), Path(target), family, quant, overwrite, report, adapter)
