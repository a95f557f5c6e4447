"""Whether a picture run recomputes activations: asked for, turned off, or (automatic) only on a GPU where the
memory planner's peak without recompute does not fit; the Recipe page, ``tunedeck plan`` and the run choose alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_vision_recipe import idefics, pictures, session_of  # noqa: F401  (fixtures)
from test_vision_train import config

from app.pages.recipe import planned
from engine.hardware import gpus
from engine.hardware.planner import CONTEXT_BYTES, GIB, SAFETY_MARGIN
from engine.hardware.profile import DeviceTarget
from engine.hardware.shapes import load_shape
from engine.run import vision_session
from engine.vision.families import IDEFICS3
from engine.vision.model import model_config_dict
from engine.vision.recipe import picture_plan
from engine.vision.speed import choose_recompute

H100 = next(spec for spec in gpus.GPUS if "H100" in spec.name)


@pytest.mark.parametrize(
    ("mode", "on_gpu", "peak", "budget", "on"),
    [
        ("standard", False, None, None, True),
        ("offloaded", True, 1, 100, True),
        ("none", True, 200, 100, False),
        ("auto", False, 200, 100, False),  # a CPU run never recomputes unless asked
        ("auto", True, None, 100, True),  # no plan: the safe choice
        ("auto", True, 100, None, True),
        ("auto", True, 100, 110, True),  # fits, but not with the planner's margin
        ("auto", True, 100, 111, False),
        ("auto", True, 1000, 80, True),
    ],
)
def test_the_choice_follows_the_mode_and_the_plan(
    mode: str, on_gpu: bool, peak: int | None, budget: int | None, on: bool
) -> None:
    chosen = choose_recompute(mode, on_gpu, peak, budget)
    assert chosen.on is on and chosen.why


def test_a_gpu_run_recomputes_only_where_its_largest_micro_batch_does_not_fit(
    idefics: Path,  # noqa: F811
    pictures: tuple[Path, Any],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data, _ = pictures
    settings = config(idefics, data, tmp_path, max_steps=1)
    session = session_of(settings, tmp_path / "run")
    model_config = model_config_dict(settings.model)
    assert model_config is not None
    largest = vision_session.largest_micro_batch(session)
    row = [session.train[i] for i in largest]
    peak = vision_session.row_plan(settings, model_config, IDEFICS3, row, session.max_pixels, False, 2).peak
    cuda = torch.device("cuda")
    for reachable, on in [(int(peak * (1 + SAFETY_MARGIN)) + 1, False), (int(peak * (1 + SAFETY_MARGIN)) - 1, True)]:
        monkeypatch.setattr(vision_session, "reachable_device_memory", lambda device, r=reachable: r)
        chosen = vision_session._recompute(
            settings, model_config, IDEFICS3, session.train, session.max_pixels, cuda, torch.bfloat16
        )
        assert chosen.on is on, chosen.why
        assert f"{peak / GIB:.1f} GiB of {reachable / GIB:.1f} GiB usable" in chosen.why
    settings.speed.checkpointing = "none"  # turned off: no plan is asked for
    monkeypatch.setattr(vision_session, "reachable_device_memory", lambda device: 0)
    assert not vision_session._recompute(settings, model_config, IDEFICS3, session.train, 1, cuda, torch.bfloat16).on


def test_the_recipe_plans_the_recompute_the_run_chooses(
    idefics: Path,  # noqa: F811
    pictures: tuple[Path, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    data, report = pictures
    shape = load_shape(str(idefics))
    settings = config(idefics, data, tmp_path, epochs=1.0)
    roomy = DeviceTarget.from_spec(H100)
    peaks = {}
    for mode in ("none", "standard"):
        settings.speed.checkpointing = mode
        peaks[mode] = planned(settings, shape, roomy, report).peak_bytes
    assert peaks["none"] and peaks["standard"] and peaks["standard"] < peaks["none"]
    settings.speed.checkpointing = "auto"
    assert planned(settings, shape, roomy, report).peak_bytes == peaks["none"]  # room enough: no recompute
    short = (CONTEXT_BYTES + peaks["none"] * (1 + SAFETY_MARGIN) - 1) / GIB
    tight = DeviceTarget.from_spec(H100, vram_gib=short)
    assert planned(settings, shape, tight, report).peak_bytes == peaks["standard"]


def test_plan_sizes_a_picture_micro_batch_with_the_recompute_a_run_would_choose(idefics: Path) -> None:  # noqa: F811
    def peak(card: DeviceTarget, checkpointing: str) -> int:
        found = picture_plan(str(idefics), card, qlora=False, lora_rank=16, checkpointing=checkpointing,
                             max_pixels=None, text_tokens=None)  # fmt: skip
        assert found is not None
        return found.peak_bytes

    roomy = DeviceTarget.from_spec(H100)
    without, recomputed = peak(roomy, "none"), peak(roomy, "standard")
    assert recomputed < without and peak(roomy, "auto") == without
    tight = DeviceTarget.from_spec(H100, vram_gib=(CONTEXT_BYTES + without * (1 + SAFETY_MARGIN) - 1) / GIB)
    assert peak(tight, "auto") == recomputed


def calls_in_one_step(session: Any) -> dict[str, int]:
    """Forward calls of the vision tower's and the language model's modules in one training step."""
    from engine.run.vision_loop import train_step

    counts = {"vision": 0, "language": 0}
    hooks = []
    for name, module in session.model.base_model.model.named_modules():
        part = session.family.part_of(name)
        if part in counts and not list(module.children()):  # leaves: each call is one of the part's operations

            def count(*_: Any, part: str = part) -> None:
                counts[part] += 1

            hooks.append(module.register_forward_pre_hook(count))
    stepping = train_step(session)
    while True:
        try:
            next(stepping)
        except StopIteration:
            break
    for hook in hooks:
        hook.remove()
    return counts


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "idefics3", "mllama"])
def test_recompute_runs_the_frozen_tower_once_and_trains_the_same(
    family: str,
    pictures: tuple[Path, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """transformers' recompute switches on input gradients for every sub-model, the tower's patch embedding
    included; a frozen tower must not run a backward pass and a second forward for them."""
    from vision_models import build_vision_model

    from engine.vision.families import family_of

    folder = build_vision_model(tmp_path / family, family)
    model_config = model_config_dict(config(folder, pictures[0], tmp_path).model)
    assert model_config is not None
    calls, losses = {}, {}
    for mode in ("none", "standard"):
        settings = config(folder, pictures[0], tmp_path / mode, max_steps=2)
        settings.speed.checkpointing = mode
        session = started(settings, tmp_path / mode, family_of(model_config))
        calls[mode] = calls_in_one_step(session)
        calls_in_one_step(session)
        losses[mode] = session.last_loss
    assert calls["standard"]["language"] > calls["none"]["language"]  # the language model is recomputed
    assert calls["standard"]["vision"] == calls["none"]["vision"] > 0  # the frozen tower is not
    assert losses["standard"] == pytest.approx(losses["none"], rel=1e-5)


def test_the_plan_counts_the_image_tokens_the_pictures_carry_not_the_budgets(
    pictures: tuple[Path, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Pictures smaller than the pixel budget carry fewer image tokens than the budget allows: the run plans its
    micro-batches (and chooses its recompute) with their own."""
    from vision_models import build_vision_model

    from engine.hardware.planner import TrainSetup
    from engine.vision.families import QWEN_VL
    from engine.vision.memory import vision_memory, vision_step_estimate

    folder = build_vision_model(tmp_path / "qwen", "qwen2_5_vl")
    settings = config(folder, pictures[0], tmp_path, max_steps=1)
    session = started(settings, tmp_path / "run", QWEN_VL)
    model_config = model_config_dict(settings.model)
    assert model_config is not None
    row = [session.train[i] for i in vision_session.largest_micro_batch(session)]
    carried = sum(item.image_tokens for item in row)
    at_budget = len(row) * vision_memory(model_config, QWEN_VL, session.max_pixels, 4).image_tokens
    assert 0 < carried < at_budget  # 40x32 pictures under the family's 802,816-pixel budget
    planned = vision_session.planned_memory(session, model_config)
    assert planned.parts["image_tokens"] == carried
    padded = max(len(item) for item in row) * len(row)
    setup = TrainSetup(tokens=padded - carried, qlora=False, lora_rank=settings.lora.sized().rank,
                       checkpointing="none", dtype_bytes=4)  # fmt: skip
    budgets = vision_step_estimate(model_config, QWEN_VL, setup, images_per_row=len(row), max_pixels=session.max_pixels)
    assert budgets.parts["image_tokens"] == at_budget and planned.peak < budgets.peak


def started(settings: Any, run_dir: Path, family: Any) -> Any:
    starting = vision_session.start_vision(settings, run_dir, family)
    while True:
        try:
            next(starting)
        except StopIteration as done:
            return done.value
