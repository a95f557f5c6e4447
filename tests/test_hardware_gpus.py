"""Forgiving GPU name matching against the built-in table."""

from __future__ import annotations

import pytest

from engine.hardware.gpus import GPUS, find_gpu


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("4060 laptop", "RTX 4060 Laptop"),
        ("NVIDIA GeForce RTX 4060 Laptop GPU", "RTX 4060 Laptop"),
        ("4060", "RTX 4060"),
        ("rtx 4060 ti", "RTX 4060 Ti"),
        ("4090 mobile", "RTX 4090 Laptop"),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", "RTX 3060 Laptop"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("Tesla T4", "Tesla T4"),
        ("t4", "Tesla T4"),
        ("NVIDIA GB10", "GB10"),
        ("DGX Spark", "GB10"),
        ("NVIDIA A10G", "A10G"),
        ("L40S", "L40S"),
        ("b200", "B200"),
        ("h200", "H200"),
    ],
)
def test_find_gpu(query: str, expected: str) -> None:
    spec = find_gpu(query)
    assert spec is not None and spec.name == expected


def test_unknown_gpu() -> None:
    assert find_gpu("Voodoo 5 6000") is None


def test_table_is_sane() -> None:
    names = [spec.name for spec in GPUS]
    assert len(names) == len(set(names)) and len(names) > 80
    for spec in GPUS:
        assert spec.vram_gib > 0 and spec.tflops > 0 and spec.compute_capability >= (7, 0)
        assert find_gpu(spec.name) is spec
    assert find_gpu("GB10").unified_memory  # type: ignore[union-attr]
