"""benchmarks/qlora_projection_groups.py: the grouped and folded projections compute what the separate ones do."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import benchmark_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmark_script("qlora_projection_groups")


@pytest.mark.parametrize("variant", ["folded_a", "grouped"])
def test_each_variant_gives_the_separate_outputs_and_gradients(bench: ModuleType, variant: str) -> None:
    """In float32 on the CPU the variants differ from one product per projection only in summation order."""
    group = bench.make_group("q/k/v", 48, [48, 16, 16], 8, torch.device("cpu"), torch.float32, seed=3)
    x = torch.randn(40, 48, dtype=torch.float64).float()
    want = bench.gradients(bench.variant_fn("separate", group), x, group)
    got = bench.gradients(bench.variant_fn(variant, group), x, group)
    assert len(got) == len(want) == 3 + 1 + 6  # outputs; the input's gradient; A and B per member
    assert bench.max_relative_error(got, want) < 1e-5


def test_a_dropped_member_shows_as_an_error(bench: ModuleType) -> None:
    """The check before timing would catch a variant that mixes the members up."""
    group = bench.make_group("gate/up", 32, [40, 40], 4, torch.device("cpu"), torch.float32, seed=4)
    x = torch.randn(24, 32)
    want = bench.gradients(bench.variant_fn("separate", group), x, group)
    swapped = bench.Group(group.name, group.weights[::-1], group.lora_a, group.lora_b, group.scale)
    got = bench.gradients(bench.variant_fn("grouped", swapped), x, group)
    assert bench.max_relative_error(got, want) > 0.1


def test_a_dry_run_writes_every_variant_and_the_step_estimate(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "groups.json"
    assert bench.main(["--tiny", "--reps", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert [(r["group"], r["variant"]) for r in report["rows"]] == [
        (group, variant) for group in ("q/k/v", "gate/up") for variant in bench.VARIANTS
    ]
    assert all(r["max_relative_error"] < 1e-5 and r["forward_backward_ms"] > 0 for r in report["rows"])
    assert report["layers"] == 32 and report["step"]["separate"]["saved_ms_per_step"] == 0
    assert "| grouped |" in out.with_suffix(".md").read_text(encoding="utf-8")
