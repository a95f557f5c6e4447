"""The memory-peak breakdown: replaying an allocator trace finds what is alive at the peak, and where from."""

from __future__ import annotations

from engine.bench.memory import MIB, allocation_site, live_at_peak, peak_table

MODEL = [
    {"filename": "/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
    {"filename": "/site-packages/transformers/models/llama/modeling_llama.py", "line": 160, "name": "forward"},
]
LOSS = [{"filename": "/repo/engine/speed/fused_loss.py", "line": 120, "name": "_chunk_loss_and_grad"}]


def alloc(addr: int, mib: int, frames: list[dict[str, object]]) -> dict[str, object]:
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": frames}


def free(addr: int) -> dict[str, object]:
    return {"action": "free_completed", "addr": addr}


TRACE = [
    alloc(1, 100, MODEL),
    alloc(2, 50, MODEL),
    {"action": "free_requested", "addr": 1},  # not yet returned: still counted
    alloc(3, 30, LOSS),  # peak: 1 + 2 + 3 = 180 MiB
    free(1),
    free(3),
    alloc(4, 120, LOSS),  # 50 + 120 = 170 MiB: below the peak
    free(2),
]


def test_the_live_set_is_taken_at_the_peak() -> None:
    assert sorted(e["addr"] for e in live_at_peak(TRACE)) == [1, 2, 3]
    assert live_at_peak([]) == []


def test_sites_skip_torch_frames() -> None:
    assert allocation_site(MODEL) == "modeling_llama.py:160 forward"
    assert allocation_site(MODEL[:1]) == "torch internals"
    assert allocation_site([]) == "unknown (no stack recorded)"


def test_table_sums_by_site_largest_first() -> None:
    table = peak_table(TRACE, before_bytes=1000 * MIB, peak_bytes=1180 * MIB)
    lines = table.splitlines()
    assert lines[0].startswith("peak allocated 1,180 MiB = 1,000 MiB allocated before the step + 180 MiB")
    assert "150.0" in lines[3] and "modeling_llama.py:160 forward" in lines[3] and lines[3].split()[1] == "2"
    assert "30.0" in lines[4] and "fused_loss.py:120 _chunk_loss_and_grad" in lines[4]
