"""Plans a user can compare: Qwen3-0.6B and Qwen3-4B on a detected RTX 4090 (faked nvml and torch).

The 0.6B planned at 21.2 GiB and the 4B at 9.8 GiB looked inconsistent. The 0.6B's plan is right, and now says why:
its 12,032-token rows fit with no recompute (the fastest way), so every layer keeps its activations, 19.4 GiB of
them; with checkpointing the same rows would need a fraction. The 4B's was wrong: it was planned with its MLPs in
chunks, which the engine switches on only where memory is short (engine.speed.chunked_mlp), and it is not short
there. Planned by the engine's rule, its 16,384-token rows with offloaded checkpointing need 11.7 GiB. Planning reads
configs only: a fresh process plans every gallery model for every card of the GPU table without importing torch or
growing by anything near one model's weights.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from engine.hardware.detect import detect_hardware
from engine.hardware.planner import GIB, estimate_memory, row_working_bytes, setup_from_speed_state
from engine.hardware.profile import Profile, build_profile
from engine.hardware.shapes import load_shape
from engine.speed import chunked_mlp
from tests.hardware_fakes import FakeGpu, FakeNvml, fake_torch


@pytest.fixture(scope="module")
def rtx_4090() -> object:
    gpu = FakeGpu("NVIDIA GeForce RTX 4090", (8, 9), 24, 128, used_gib=0.0)
    return detect_hardware(nvml=FakeNvml([gpu]), torch=fake_torch([gpu]))


def lora_plan(hardware: object, model: str) -> Profile:
    return build_profile(hardware, load_shape(model), overrides={"qlora": False})  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-4b"])
def test_the_breakdown_adds_up_to_the_peak_and_names_the_row(rtx_4090: object, model: str) -> None:
    plan = lora_plan(rtx_4090, model).memory_plan
    assert plan is not None and plan.fits and plan.tokens is not None
    estimate = plan.estimate
    assert sum(size for _, size in estimate.breakdown()) == estimate.peak
    assert [size for _, size in estimate.breakdown()] == sorted((s for _, s in estimate.breakdown()), reverse=True)
    why = plan.reasons["memory"]
    assert why.startswith(f"{estimate.gib():.1f} GiB for {plan.tokens:,}-token rows with "), why
    assert "weights" in why and "LoRA adapter" in why


def test_the_small_model_spends_its_spare_memory_on_skipping_the_recompute(rtx_4090: object) -> None:
    small, large = (lora_plan(rtx_4090, name).memory_plan for name in ("qwen3-0.6b", "qwen3-4b"))
    assert small is not None and large is not None and small.tokens is not None and large.tokens is not None
    assert (small.checkpointing, large.checkpointing) == ("none", "offloaded")
    assert small.estimate.gib() == pytest.approx(21.2, abs=0.05) and small.tokens == 12_032
    assert small.estimate.breakdown()[0][0] == "activations kept for backward"
    assert "without it only 2,304 tokens fit" in large.reasons["checkpointing"]
    # planned with the 4B's rows and checkpointing, the 0.6B needs less; its own reason says how little it would
    same_as_large = {"qlora": False, "checkpointing": "offloaded", "tokens_per_batch": large.tokens}
    as_large = build_profile(rtx_4090, load_shape("qwen3-0.6b"), overrides=same_as_large).memory_plan  # type: ignore[arg-type]
    assert as_large is not None and as_large.tokens == large.tokens
    assert as_large.estimate.peak < large.estimate.peak
    leaner = re.search(r"with offloaded checkpointing the same rows would need ~([0-9.]+) GiB", small.reasons["memory"])
    assert leaner is not None, small.reasons["memory"]
    assert float(leaner.group(1)) < large.estimate.gib() < small.estimate.gib()


def test_the_larger_model_is_planned_as_the_engine_will_run_it(rtx_4090: object) -> None:
    shape = load_shape("qwen3-4b")
    plan = lora_plan(rtx_4090, "qwen3-4b").memory_plan
    assert plan is not None and plan.tokens == 16_384
    free = plan.budget_bytes - plan.estimate.weights - plan.estimate.adapter  # what the engine sees after loading
    on, _ = chunked_mlp.resolve(
        None, plan.checkpointing, plan.tokens, working_bytes=row_working_bytes(shape, plan.tokens), free_bytes=free
    )
    assert not on, "the engine would chunk these rows"
    assert "chunks" not in plan.reasons["tokens_per_batch"]
    state = {"checkpointing": {"mode": plan.checkpointing}, "chunked_mlp": {"on": on}, "fused_kernels": {"on": True},
             "metadata_cache": {"on": True, "backend": "varlen"}, "lora_16bit": {"on": True},
             "fused_loss": {"on": True}}  # fmt: skip
    unchunked = estimate_memory(shape, setup_from_speed_state(state, shape, plan.tokens), (8, 9))
    assert plan.estimate.peak == pytest.approx(unchunked.peak, rel=0.01)
    assert plan.estimate.gib() == pytest.approx(11.7, abs=0.05)


PLAN_EVERYTHING = """
import json, sys
import psutil
from engine.hardware import gpus
from engine.hardware.gallery import gallery_rows
from engine.hardware.profile import DeviceTarget
before = psutil.Process().memory_info().rss
rows = [row for spec in gpus.GPUS for row in gallery_rows(DeviceTarget.from_spec(spec))]
after = psutil.Process().memory_info().rss
print(json.dumps({"rows": len(rows), "growth": after - before, "torch": "torch" in sys.modules}))
"""


def test_planning_every_model_for_every_card_reads_configs_only() -> None:
    out = subprocess.run([sys.executable, "-c", PLAN_EVERYTHING], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["rows"] > 100
    assert not result["torch"], "planning imported torch"
    # Qwen3-0.6B's bf16 weights alone are 1.1 GiB; planning 1,000 model-card pairs grows the process by under 1 MiB
    assert result["growth"] < 64 * 2**20, f"planning grew the process by {result['growth'] / GIB:.2f} GiB"


def test_the_gallery_and_the_model_page_show_the_row_and_what_fills_it(rtx_4090: object) -> None:
    from app.widgets.model_gallery import COLUMNS, PEAK_COLUMN, row_cells
    from app.widgets.model_words import memory_html
    from engine.hardware.gallery import gallery_rows
    from engine.hardware.recipes import automatic_estimate, describe_peak
    from engine.hardware.shapes import load_shape
    from engine.model.info import ModelInfo

    rows = {row.entry.key: row for row in gallery_rows(rtx_4090)}  # type: ignore[arg-type]
    memory = COLUMNS.index(PEAK_COLUMN)
    for key in ("qwen3-0.6b", "qwen3-4b"):  # the Automatic recipe's figure, as the Recipe page shows it
        automatic = automatic_estimate(load_shape(key), rtx_4090)
        cell = f"{describe_peak(automatic)} ({automatic.tokens_per_batch:,}-token rows)"
        assert row_cells(rows[key])[memory] == cell
    assert rows["qwen3-0.6b"].lora is not None and rows["qwen3-0.6b"].lora.memory.startswith(
        "21.2 GiB for 12,032-token rows with no recompute"
    ), "the longest planned row's peak (the row's tooltip)"
    assert rows["qwen3-4b"].lora is not None and rows["qwen3-4b"].lora.memory.startswith(
        "11.7 GiB for 16,384-token rows with offloaded"
    )
    profile = lora_plan(rtx_4090, "qwen3-0.6b")
    html = memory_html(ModelInfo("Qwen/Qwen3-0.6B", "qwen3", 1, False, "fits", "", profile=profile))
    assert html.startswith("<p>What fills the memory: 21.2 GiB for 12,032-token rows with no recompute: ")
    assert "activations kept for backward 19.4 GiB" in html
