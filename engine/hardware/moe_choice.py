"""The automatic MoE routing choice, in one place for the run (engine.speed) and the device profile (detect/app).

Measured on an H200 (benchmarks/speed_h200.md, Qwen3-30B-A3B block, 8,192 tokens, forward + backward): in bf16,
where torch's grouped_mm is one kernel (sm_90/100/103), sync-free routing took 7.2 ms against 9.8 ms for
transformers' stock grouped_mm and 32.2 ms for bincount; in fp16, which takes the per-group fallback that RTX and
GB10 cards take in bf16, sync-free took 30.5 ms (one sync per layer) against 33.1 ms for bincount. Torch-free, so
the app's profile page can use it without loading torch.
"""

from __future__ import annotations

GROUPED_MM_FAST_PATH = frozenset({(9, 0), (10, 0), (10, 3)})
"""Compute capabilities where grouped_mm runs as one kernel in bf16."""


def auto_moe_routing(
    has_experts: bool, on_gpu: bool, compute_capability: tuple[int, int] | None, dtype: str
) -> tuple[str, str]:
    """(mode, reason) that ``moe_routing = "auto"`` resolves to; ``dtype`` is e.g. "bfloat16"."""
    if not has_experts:
        return "stock", "no MoE expert layers in this model"
    if not on_gpu:
        return "bincount", "CPU: experts on sorted token slices, counted with one bincount per layer"
    sm = f"sm_{compute_capability[0]}{compute_capability[1]}" if compute_capability else "this GPU"
    if compute_capability in GROUPED_MM_FAST_PATH and dtype == "bfloat16":
        return "sync-free", f"grouped_mm is one kernel on {sm} in bf16: routing with no syncs (7.2 vs 9.8 ms stock)"
    return "sync-free", (
        f"grouped_mm falls back to a per-expert loop on {sm} in {dtype}: sorted routing with one sync per layer"
    )
