"""One profiled step: GPU time by kernel kind, busy time, and the host operators' own time."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from engine.bench.qlora import markdown
from engine.bench.step_profile import kernel_category, profile_step, timeline

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "history" / "qlora_fp8_h200.json"


@pytest.mark.parametrize(
    ("name", "trace_category", "kind"),
    [
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "kernel", "gemm"),
        ("void cutlass::device_kernel<cutlass3x_sm90_tensorop_gemm_e4m3>", "kernel", "gemm"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "kernel", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "kernel", "attention"),
        ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>", "kernel", "dequant"),
        ("four_bit_decode_kernel", "kernel", "dequant"),
        ("cross_entropy_grad", "kernel", "triton"),
        ("triton_poi_fused_add_mul_silu_silu_backward_view_2", "kernel", "triton"),
        ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", "copies"),
        ("Memset (Device)", "gpu_memset", "copies"),
        ("void at::native::multi_tensor_apply_kernel<...>", "kernel", "other"),
    ],
)
def test_kernels_are_sorted_by_kind(name: str, trace_category: str, kind: str) -> None:
    assert kernel_category(name, trace_category) == kind


def test_busy_time_is_the_union_of_kernels_without_the_side_stream_copies() -> None:
    events = [
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 10_000},
        {"cat": "kernel", "name": "triton_poi_fused", "ts": 5_000, "dur": 10_000},  # overlaps the first
        {"cat": "kernel", "name": "flash_fwd", "ts": 20_000, "dur": 10_000},  # after a 5 ms gap
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 0, "dur": 100_000},  # beside them
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50_000},  # host side: not GPU time
    ]
    summary = timeline(events)
    assert summary["gpu_busy_ms"] == 25.0 and summary["gpu_span_ms"] == 30.0
    assert summary["gpu_ms"]["gemm"] == 10.0 and summary["gpu_ms"]["copies"] == 100.0
    assert summary["gpu_ms"]["attention"] == 10.0 and summary["gpu_ms"]["dequant"] == 0.0
    assert timeline([]) == {"gpu_ms": dict.fromkeys(summary["gpu_ms"], 0.0), "gpu_busy_ms": 0.0, "gpu_span_ms": 0.0}


def test_a_profiled_step_writes_its_host_operators(tmp_path: Path) -> None:
    weight = torch.randn(256, 256, requires_grad=True)

    def step() -> None:
        (torch.randn(64, 256) @ weight).square().sum().backward()

    summary = profile_step(step, tmp_path, "tiny")
    table = (tmp_path / "tiny_host_ops.txt").read_text(encoding="utf-8")
    assert "aten::mm" in table and summary["host_self_ms"] > 0
    if not torch.cuda.is_available():
        assert summary["gpu_busy_ms"] == 0.0


def test_profiled_rows_get_their_own_table() -> None:
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    assert "GPU busy" not in markdown(report)  # no row was profiled
    profiled = copy.deepcopy(report)
    row = profiled["models"][0]["rows"][0]
    row["host_ms"] = 398.0
    row["profile"] = {
        "gpu_ms": {"gemm": 248.0, "attention": 47.0, "dequant": 19.0, "triton": 38.0, "copies": 41.0, "other": 6.0},
        "gpu_busy_ms": 362.0,
        "gpu_span_ms": 383.0,
        "host_self_ms": 452.0,
    }
    text = markdown(profiled)
    assert "| GPU busy | gemm | attention | dequant | triton | copies | other | host ops |" in text
    assert f"| {row['ms_per_step']:.0f} | 398 | 362 | 248 | 47 | 19 | 38 | 41 | 6 | 452 |" in text


def test_gaps_name_the_kernels_around_them_and_the_host_work_meanwhile() -> None:
    from engine.bench.step_profile import gaps, kernel_table

    events = [
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 10_000},
        {"cat": "kernel", "name": "triton_red_fused", "ts": 10_020, "dur": 1_000},  # 20 µs: not a gap
        {"cat": "kernel", "name": "flash_fwd", "ts": 15_000, "dur": 1_000},  # 3.98 ms after the last
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 16_500, "dur": 500},  # 0.5 ms after
        {"cat": "cpu_op", "name": "Optimizer.step#AdamW.step", "ts": 11_500, "dur": 3_000},
        {"cat": "cpu_op", "name": "aten::add_", "ts": 12_000, "dur": 10},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # before the gap
    ]
    found = gaps(events)
    assert [round(g["ms"], 2) for g in found] == [3.98, 0.5]
    first = found[0]
    assert (first["before"], first["after"]) == ("triton_red_fused", "flash_fwd")
    assert first["host"] == ["Optimizer.step#AdamW.step", "aten::add_"] and round(first["at_ms"], 2) == 11.02
    table = kernel_table(events).splitlines()
    assert table[1].split()[:3] == ["10.500", "2", "gemm"]
    assert gaps([]) == []
