"""The Recipe page's memory, steps and time for a vision-language model on an image dataset: planned from the
Dataset page's report as the run plans itself (the vision tower, the image tokens at the pixel budget, padded
micro-batches), so the page and the run agree, and a card too small says what the pictures cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_vision_train import colour_rows, config
from vision_models import build_vision_model

from app.pages.recipe import fit_warning, planned
from engine.hardware import gpus
from engine.hardware.planner import CONTEXT_BYTES, GIB
from engine.hardware.profile import DeviceTarget
from engine.hardware.recipes import estimate_recipe
from engine.hardware.shapes import load_shape
from engine.model.info import ModelInfo
from engine.run.data_report import analyze_dataset
from engine.run.vision_session import VisionSession, planned_memory, start_vision
from engine.vision.families import IDEFICS3
from engine.vision.model import model_config_dict
from engine.vision.recipe import image_estimate_for

pytest_plugins = ["app_fixtures"]

CPU = DeviceTarget(None, gpus.CPU, None, 16 * GIB, cpu_cores=4)


@pytest.fixture(scope="module")
def idefics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("idefics3"), "idefics3")


@pytest.fixture(scope="module")
def pictures(idefics: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The colour dataset and its Dataset page report."""
    data = colour_rows(tmp_path_factory.mktemp("colours"))
    return data, analyze_dataset(str(data), str(idefics))


def session_of(settings: Any, run_dir: Path) -> VisionSession:
    starting = start_vision(settings, run_dir, IDEFICS3)
    while True:
        try:
            next(starting)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@pytest.mark.parametrize("epochs", [2.0, 0.0])  # 0: the automatic choice for the dataset
def test_the_recipe_plans_the_memory_and_steps_the_picture_run_plans(
    idefics: Path, pictures: tuple[Path, Any], tmp_path: Path, epochs: float
) -> None:
    data, report = pictures
    settings = config(idefics, data, tmp_path, epochs=epochs)
    estimate = planned(settings, load_shape(str(idefics)), CPU, report)
    session = session_of(settings, tmp_path)
    assert estimate.steps == session.total_steps
    model_config = model_config_dict(settings.model)
    assert model_config is not None
    assert estimate.peak_bytes == planned_memory(session, model_config).peak
    assert estimate.seconds is not None and estimate.seconds > 0


def test_the_vision_tower_and_the_pixel_budget_count_in_memory_and_time(
    idefics: Path, pictures: tuple[Path, Any], tmp_path: Path
) -> None:
    data, report = pictures
    shape = load_shape(str(idefics))
    settings = config(idefics, data, tmp_path, epochs=1.0)
    text = estimate_recipe(settings, shape, CPU, report.total_tokens, len(report.lengths))
    settings.vision.max_pixels = 32 * 32  # one tile of the tiny model's 32-pixel images
    small = image_estimate_for(settings, shape, CPU, report)
    settings.vision.max_pixels = 4 * 32 * 32  # four tiles and the whole image
    large = image_estimate_for(settings, shape, CPU, report)
    settings.vision.adapt_vision = True
    adapted = image_estimate_for(settings, shape, CPU, report)
    assert small is not None and large is not None and adapted is not None
    assert small.peak_bytes and large.peak_bytes and adapted.peak_bytes
    assert small.peak_bytes != text.peak_bytes  # planned as padded picture rows, not packed text rows
    assert small.peak_bytes < large.peak_bytes < adapted.peak_bytes  # more image tokens; the tower's activations
    assert small.seconds and large.seconds and small.seconds < large.seconds


def test_a_card_too_small_for_the_pictures_says_what_they_cost(
    idefics: Path, pictures: tuple[Path, Any], tmp_path: Path
) -> None:
    data, report = pictures
    shape = load_shape(str(idefics))
    spec = next(spec for spec in gpus.GPUS if "H100" in spec.name)
    card = DeviceTarget.from_spec(spec, vram_gib=(CONTEXT_BYTES + 2**20) / GIB)  # a megabyte past the context
    settings = config(idefics, data, tmp_path, epochs=1.0)
    estimate = planned(settings, shape, card, report)
    assert not estimate.fits and "the vision tower's" in estimate.reason and "image tokens" in estimate.reason
    info = ModelInfo(str(idefics), "idefics3", shape.total_params(), False, "fits", "", shape=shape)
    warning = fit_warning(settings, info, card, report)
    assert warning is not None and "vision.max_pixels" in warning
    roomy = DeviceTarget.from_spec(spec)
    fitting = planned(settings, shape, roomy, report)
    assert fitting.fits and fitting.seconds and fitting.steps == 1
    assert fit_warning(settings, info, roomy, report) is None


def test_plan_says_what_the_pictures_of_a_vision_language_model_cost(
    idefics: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli.plan import plan_main

    assert plan_main(["--model", str(idefics), "--gpu", "RTX 4090"]) == 0
    text = capsys.readouterr().out
    # the tiny tower sees 32-pixel tiles of 8-pixel patches: 16 tokens a tile, 17 tiles and the whole image
    assert "Pictures (Idefics3 / SmolVLM):" in text and "adds 288 image tokens" in text, text
    assert plan_main(["--model", str(idefics), "--gpu", "RTX 4090", "--max-pixels", "1024", "--json"]) == 0
    pictures = json.loads(capsys.readouterr().out)["pictures"]
    assert pictures["image_tokens"] == 16 and pictures["max_pixels"] == 1024 and pictures["peak_bytes"] > 0
    assert plan_main(["--model", "demo", "--gpu", "RTX 4090"]) == 0
    assert "Pictures" not in capsys.readouterr().out  # a text model


def test_the_recipe_page_plans_an_image_dataset_with_its_pictures(
    qtbot: Any, window: Any, idefics: Path, pictures: tuple[Path, Any]
) -> None:
    """The window on a vision-language model and its image dataset: the plan the Run page shows is the picture
    run's (engine.vision.recipe), not the text planner's."""
    from app_demo import LOAD_TIMEOUT_MS

    data, _ = pictures
    window.hardware_panel.detect()
    qtbot.waitUntil(lambda: window.state.hardware is not None, timeout=LOAD_TIMEOUT_MS)
    window.model_panel.choose(str(idefics))
    qtbot.waitUntil(lambda: window.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    window.data_panel.load(str(data))
    qtbot.waitUntil(lambda: window.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not window.tasks.busy(), timeout=LOAD_TIMEOUT_MS)
    panel, state = window.setup_panel, window.state
    panel.check_fit()
    assert state.data_report.images == 4
    settings = panel._form_config()
    expected = image_estimate_for(settings, state.model_info.shape, state.hardware, state.data_report)
    assert expected is not None and state.planned_peak == expected.peak_bytes
    text = estimate_recipe(settings, state.model_info.shape, state.hardware)
    assert state.planned_peak != text.peak_bytes
    assert state.planned_time is not None and state.planned_time.seconds
