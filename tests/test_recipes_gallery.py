"""The model gallery's verdicts against the planner for a faked card, and what the recipes set and predict."""

from __future__ import annotations

import math

import pytest

from engine.config import RunConfig
from engine.hardware.detect import detect_hardware
from engine.hardware.gallery import GALLERY, download_bytes, find_entry, gallery_rows, gallery_shape
from engine.hardware.profile import DeviceTarget, build_profile
from engine.hardware.recipes import RECIPE_KEYS, RECIPES, apply_recipe, estimate_recipe, find_recipe, planned_steps
from tests.hardware_fakes import FakeGpu, FakeNvml, fake_torch


def laptop_4060() -> object:
    gpu = FakeGpu("NVIDIA GeForce RTX 4060 Laptop GPU", (8, 9), 8, 24, used_gib=0.0)
    return detect_hardware(nvml=FakeNvml([gpu]), torch=fake_torch([gpu]))


def test_gallery_verdicts_follow_the_planner_on_a_faked_8_gib_laptop() -> None:
    hardware = laptop_4060()
    rows = {row.entry.key: row for row in gallery_rows(hardware)}
    assert list(rows) == [entry.key for entry in GALLERY]
    for key, row in rows.items():
        shape = gallery_shape(row.entry)
        plans = {q: build_profile(hardware, shape, overrides={"qlora": q}).memory_plan for q in (False, True)}
        assert row.lora is not None and row.qlora is not None
        assert (row.lora.fits, row.qlora.fits) == (plans[False].fits, plans[True].fits), key
        assert row.lora.peak_bytes == plans[False].estimate.peak and row.qlora.peak_bytes == plans[True].estimate.peak
        expected = "LoRA" if plans[False].fits else "QLoRA" if plans[True].fits else "too big"
        assert row.verdict == expected, key
        used = plans[False] if expected == "LoRA" else plans[True]
        assert row.longest_tokens == (used.longest_tokens if expected != "too big" else None), key
    # what an 8 GiB card does with them: small models with LoRA, 8B only in 4 bits, 30B MoE not at all
    assert rows["qwen3-0.6b"].verdict == "LoRA"
    assert rows["llama-3.1-8b"].verdict == "QLoRA"
    assert rows["qwen3-30b-a3b"].verdict == "too big" and rows["qwen3-30b-a3b"].longest_tokens is None
    assert rows["demo"].download_bytes == 0


def test_a_bigger_card_from_the_table_trains_more_with_lora() -> None:
    from engine.hardware import gpus

    small = {row.entry.key: row.verdict for row in gallery_rows(laptop_4060())}
    big = {row.entry.key: row.verdict for row in gallery_rows(DeviceTarget.from_spec(gpus.find_gpu("RTX 3090")))}
    assert small["llama-3.1-8b"] == "QLoRA" and big["llama-3.1-8b"] == "LoRA"
    assert sum(v == "LoRA" for v in big.values()) > sum(v == "LoRA" for v in small.values())


def test_on_the_cpu_qlora_is_not_offered() -> None:
    hardware = detect_hardware(nvml=None, torch=None)
    rows = gallery_rows(hardware)
    assert all(row.qlora is None for row in rows)
    assert {row.verdict for row in rows} <= {"LoRA", "too big"}


def test_download_sizes_are_the_16_bit_weights_and_hub_ids_resolve() -> None:
    qwen = find_entry("Qwen/Qwen3-0.6B")
    assert qwen is not None and qwen.key == "qwen3-0.6b"
    assert download_bytes(qwen, gallery_shape(qwen)) == 2 * gallery_shape(qwen).total_params()
    oss = find_entry("openai/gpt-oss-20b")
    assert oss is not None
    shape = gallery_shape(oss)
    assert download_bytes(oss, shape) < 2 * shape.total_params() / 2, "gpt-oss ships 4-bit experts"
    assert find_entry("demo") is not None and find_entry("someone/unknown") is None


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_a_recipe_sets_what_it_claims_and_nothing_else(recipe: object) -> None:
    base = RunConfig.from_dict({"output": {"dir": "/tmp/elsewhere"}, "speed": {"checkpointing": "offloaded"},
                                "model": {"qlora": True}})  # fmt: skip
    config = apply_recipe(base, recipe)  # type: ignore[arg-type]
    raw, defaults, before = config.to_dict(), RunConfig().to_dict(), base.to_dict()
    for key in RECIPE_KEYS:
        section, name = key.split(".")
        wanted = recipe.settings.get(key, defaults[section][name])  # type: ignore[attr-defined]
        assert raw[section][name] == wanted, key
    for section, values in raw.items():
        for name, value in values.items():
            if f"{section}.{name}" not in RECIPE_KEYS:
                assert value == before[section][name], f"{section}.{name} changed"


def test_switching_recipes_leaves_nothing_of_the_first() -> None:
    base = RunConfig()
    for first in RECIPES:
        for second in RECIPES:
            assert apply_recipe(apply_recipe(base, first), second) == apply_recipe(base, second)


def test_recipe_estimates_are_the_planners() -> None:
    hardware = laptop_4060()
    shape = gallery_shape(find_entry("qwen3-1.7b"))  # type: ignore[arg-type]
    config = apply_recipe(RunConfig(), find_recipe("Balanced"))
    estimate = estimate_recipe(config, shape, hardware, dataset_tokens=1_000_000)
    profile = build_profile(hardware, shape, overrides={"qlora": False, "tokens_per_batch": 4096}, lora_rank=16,
                            min_tokens=2048)  # fmt: skip
    assert estimate.fits and estimate.peak_bytes == profile.memory_plan.estimate.peak
    assert estimate.steps == math.ceil(1_000_000 / 4096) == planned_steps(config, 1_000_000)
    assert profile.tokens_per_second is not None
    assert estimate.seconds == pytest.approx(estimate.steps * 4096 / profile.tokens_per_second)
    longer = estimate_recipe(apply_recipe(config, find_recipe("Long context")), shape, hardware, 1_000_000)
    assert longer.peak_bytes > estimate.peak_bytes
    big = gallery_shape(find_entry("qwen3-14b"))  # type: ignore[arg-type]
    too_big = estimate_recipe(config, big, hardware)
    assert not too_big.fits and too_big.seconds is None and "GiB" in too_big.reason
    assert planned_steps(config, None) is None
    assert planned_steps(apply_recipe(config, find_recipe("Quick test")), None) == 30
