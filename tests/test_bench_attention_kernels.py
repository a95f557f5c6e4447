"""benchmarks/attention_kernels.py: its float32 reference keeps documents apart, and its report reads right."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import benchmark_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmark_script("attention_kernels")


def test_the_reference_is_causal_attention_within_each_document(bench: ModuleType) -> None:
    q, k, v = torch.randn(24, 4, 8), torch.randn(24, 2, 8), torch.randn(24, 2, 8)
    whole = bench.reference(q, k, v, [24])
    assert torch.allclose(whole, bench.sdpa(q, k, v, None), atol=1e-6)
    split = bench.reference(q, k, v, [10, 14])
    assert torch.allclose(split[:10], whole[:10], atol=1e-6)  # the first document sees what it saw before
    assert torch.allclose(split[10:], bench.reference(q[10:], k[10:], v[10:], [14]), atol=1e-6)
    assert not torch.allclose(split[10:], whole[10:], atol=1e-3)  # and the second no longer sees the first


def test_dense_kernels_time_only_one_document_rows(bench: ModuleType) -> None:
    cuda = torch.device("cuda")
    assert bench.kernels_for(1, cuda) == ["flash_varlen", "cudnn", "sdpa", "cudnn_ragged"]
    assert bench.kernels_for(4, cuda) == ["flash_varlen", "cudnn_ragged"]
    assert bench.kernels_for(1, torch.device("cpu")) == ["sdpa"]


def test_a_dry_run_writes_the_report(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    assert bench.main(["--tiny", "--reps", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert row["kernel"] == "sdpa" and row["error"] < 1e-5 and row["forward_backward_ms"] > 0
    assert "| 64 | 1 | sdpa |" in out.with_suffix(".md").read_text(encoding="utf-8")


def test_the_table_times_each_kernel_against_flash_and_names_failures(bench: ModuleType) -> None:
    rows = [
        {"kernel": "flash_varlen", "tokens": 4096, "docs": 1, "forward_ms": 0.5, "forward_backward_ms": 2.0,
         "error": 1e-3},
        {"kernel": "cudnn", "tokens": 4096, "docs": 1, "forward_ms": 0.25, "forward_backward_ms": 1.0, "error": 2e-3},
        {"kernel": "cudnn_ragged", "tokens": 4096, "docs": 4, "failed": "not supported"},
    ]  # fmt: skip
    report = {"device": "GPU", "torch": "2", "cudnn": 9, "heads": {"query": 32, "key_value": 8, "dim": 128},
              "dtype": "bfloat16", "timing": "median", "rows": rows}  # fmt: skip
    table = bench.markdown(report)
    assert "| 4,096 | 1 | cudnn | 0.250 | 1.000 | 2.00 | 2.0e-03 |" in table
    assert "| 4,096 | 4 | cudnn_ragged | failed: not supported |" in table
