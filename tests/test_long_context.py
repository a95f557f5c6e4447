"""The long-context bench: its search, and the 8B-style model build that never holds 16-bit weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.bench.long_context import (
    build_quantized_model,
    llama_8b_config,
    longest_passing,
    markdown,
    one_document,
    peak_gib,
    planned_peak_gib,
    speed_settings,
    with_lora,
)


def threshold_probe(limit: int, calls: list[int]) -> object:
    def probe(tokens: int) -> bool:
        calls.append(tokens)
        return tokens <= limit

    return probe


def test_search_doubles_then_bisects_to_the_resolution() -> None:
    calls: list[int] = []
    found = longest_passing(threshold_probe(50_000, calls), 8192, resolution=2048)
    assert calls[:4] == [8192, 16384, 32768, 65536]  # exponential until the first failure
    assert found.longest is not None and found.shortest_failure is not None
    assert found.longest <= 50_000 < found.shortest_failure and found.resolution <= 2048  # type: ignore[operator]
    assert 50_000 - found.longest < 2048 and found.stopped == "resolution reached"
    assert all(t % 256 == 0 for t in calls) and len(calls) == len(set(calls))


def test_search_shrinks_when_the_first_probe_fails() -> None:
    calls: list[int] = []
    found = longest_passing(threshold_probe(3000, calls), 16384, resolution=512)
    assert calls[:4] == [16384, 8192, 4096, 2048]
    assert found.longest is not None and 3000 - 512 < found.longest <= 3000


def test_search_reports_when_nothing_fits_or_time_runs_out() -> None:
    assert longest_passing(threshold_probe(100, []), 4096, floor=512).longest is None
    answers = iter([True, False, None])
    found = longest_passing(lambda _: next(answers), 8192)
    assert (found.longest, found.shortest_failure, found.stopped) == (8192, 16384, "time limit")
    found = longest_passing(threshold_probe(10**9, []), 8192, ceiling=32768)
    assert found.longest == 32768 and found.stopped == "ceiling"


def test_growth_factor_narrows_the_bracket() -> None:
    calls: list[int] = []
    found = longest_passing(threshold_probe(60_000, calls), 50_000, growth=1.25, resolution=2048)
    assert calls[:2] == [49_920, 62_208] and found.longest is not None and 60_000 - found.longest < 2048


pytest.importorskip("bitsandbytes")


def tiny_llama() -> object:
    return llama_8b_config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip


def test_quantized_build_has_no_16bit_linears_and_trains() -> None:
    model = build_quantized_model(tiny_llama(), torch.device("cpu"), torch.bfloat16)
    assert not any(p.device.type == "meta" for p in model.parameters())
    assert not any(type(m) is torch.nn.Linear for m in model.get_decoder().modules())
    assert sum(type(m).__name__ == "Linear4bit" for m in model.modules()) == 2 * 7
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16
    peft_model = with_lora(model, "tunedeck")
    batch = one_document(40, 256)
    assert batch.num_tokens == 40 and batch.trained_tokens == 39
    loss = peft_model(input_ids=batch.input_ids, labels=batch.labels).loss
    loss.backward()
    assert torch.isfinite(loss) and 4.0 < float(loss.detach()) < 7.0  # about ln(256) for a random model
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)


def test_variants_turn_the_memory_switches_on_or_off() -> None:
    ours, stock = speed_settings("tunedeck"), speed_settings("stock")
    assert ours.chunked_mlp and ours.fused_loss and ours.checkpointing == "offloaded" and ours.metadata_cache
    assert not stock.chunked_mlp and not stock.fused_loss and stock.checkpointing == "standard"


def test_table_lists_every_search() -> None:
    phases = {"forward": {"peak_gib": 7.0}, "backward": {"peak_gib": 7.5}, "optimizer": {"peak_gib": 6.9}}
    probe = {"tokens": 16384, "ok": True, "steps": [{**phases, "seconds": 3.0}, {**phases, "seconds": 2.5}],
             "planned_peak_gib": 7.8123}  # fmt: skip
    report = {
        "environment": {"gpu": "H200", "date": "2026-11-30", "versions": {"torch": "2.11"}},
        "searches": [
            {"variant": "tunedeck", "cap_gib": 8.0, "longest": 16384, "shortest_failure": 18432, "resolution": 2048,
             "target": 14000, "probes": [probe, {"tokens": 18432, "ok": False}]},
        ],
    }  # fmt: skip
    table = markdown(report)
    assert "| tunedeck | 8 | 16,384 | 18,432 | 2,048 | 14,000 | 7.50 | 7.81 | 2.5 | 16,384✓, 18,432✗ |" in table


def test_a_probe_s_peak_is_its_true_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase's peak is the reserved one (step graphs' pool and cached blocks included), the allocated beside it;
    probes from before the true peak are read by their reserved peak, the same measure."""
    from engine.bench.long_context import _mem

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 7 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 2**30)
    phase = _mem(torch.device("cuda", 0))
    assert phase == {"allocated_gib": 4.0, "peak_gib": 7.0, "true_peak_gib": 7.0, "allocated_peak_gib": 5.0,
                     "reserved_gib": 7.0}  # fmt: skip
    older = {"allocated_gib": 4.0, "peak_gib": 5.0, "reserved_gib": 7.5}
    probe = {"steps": [{"forward": phase, "backward": older, "optimizer": {"peak_gib": 6.0}}]}
    assert peak_gib(probe) == 7.5
    assert peak_gib({"ok": False, "peak_gib": 6.5}) == 6.5 and peak_gib({"ok": False}) == 0.0


def test_the_stock_variant_has_every_switch_off() -> None:
    import dataclasses

    from engine.config import SpeedConfig

    stock = speed_settings("stock")
    assert stock == SpeedConfig.stock(checkpointing="standard") and stock.step_graphs is False
    assert not any(getattr(stock, f.name) for f in dataclasses.fields(SpeedConfig) if f.default is None)


def test_a_probe_s_planned_peak_is_the_planners_for_its_switches() -> None:
    """The committed 8 GiB probe at 16,384 tokens: its switches give the plan the planner's tests hold to the
    measurement (within 10% above; here with grouped K/V, which the engine now passes)."""
    data = json.loads(
        (Path(__file__).resolve().parents[1] / "benchmarks" / "history" / "long_context_h200.json").read_text()
    )
    probe = next(p for s in data["searches"] if s["cap_gib"] == 8.0 for p in s["probes"] if p["tokens"] == 16384)
    planned = planned_peak_gib(probe["state"], 16384)
    assert planned < planned_peak_gib(probe["state"], 32768)
    assert 0.95 * peak_gib(probe) < planned < 1.10 * peak_gib(probe)


def test_variants_differ_in_the_embedding_switch() -> None:
    assert speed_settings("tunedeck").host_embedding is True and speed_settings("stock").host_embedding is False
