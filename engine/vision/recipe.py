"""The Recipe page's memory and time for a vision-language run on an image dataset, before anything loads.

A text run's estimate (engine.hardware.recipes.estimate_recipe) plans packed rows of the language model. A picture
run differs in three ways the estimate must show: the vision tower's weights sit beside the language model, each
image adds its tokens at the processor's resolution (the pixel budget) to a row, and rows are padded micro-batches
of up to ``AUTOMATIC_TOKENS`` tokens rather than packed ones. The memory is the run's own planner figure
(engine.vision.memory.vision_step_estimate) for a micro-batch of the dataset's examples; the time counts the padded
tokens and the tower's forward over its patches, as many language-model tokens as the same arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.config import RunConfig
from engine.hardware.checkpoint_choice import Checkpointing
from engine.hardware.fit_to_data import FitFacts, fit_to_data
from engine.hardware.planner import GIB, MemoryEstimate, TrainSetup, usable_bytes
from engine.hardware.recipes import RecipeEstimate
from engine.hardware.row_lengths import cpu_step_seconds
from engine.vision.families import VisionFamily
from engine.vision.memory import vision_memory, vision_step_estimate
from engine.vision.speed import choose_recompute

AUTOMATIC_TOKENS = 4096
"""``data.max_seq_len`` and ``data.tokens_per_batch`` of a picture run when left automatic (0): image tokens make
rows long, and an image cannot be cut, so examples up to this length are kept and padded micro-batches hold up to
this many tokens."""


@dataclass(frozen=True)
class ImageLoad:
    """What an image dataset puts through a run, from the Dataset page's report (engine.run.data_report)."""

    examples: int
    """Usable examples."""
    images_per_example: float
    tokens_per_example: float
    """Text and image tokens of an example, on average."""
    image_tokens_per_image: float
    """As the processor encoded them at the family's pixel budget."""
    longest: int
    padding_efficiency: float
    """Real tokens over padded tokens in the report's micro-batches."""

    @classmethod
    def from_report(cls, report: Any) -> ImageLoad | None:
        """The load of a DatasetReport of an image dataset; None for a text dataset (or one with nothing usable)."""
        if report is None or not report.images or not report.lengths:
            return None
        encoded, usable = len(report.lengths), max(report.good_rows, len(report.lengths))
        images_per_example = report.images / usable
        return cls(
            examples=usable,
            images_per_example=images_per_example,
            tokens_per_example=report.total_tokens / encoded,
            image_tokens_per_image=report.image_tokens / encoded / images_per_example,
            longest=max(report.lengths),
            padding_efficiency=report.packing_efficiency or 1.0,
        )


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch a picture run plans its memory for: the largest the budget lets the data make."""

    examples: int
    images: float
    padded_tokens: int
    image_tokens: int


def planned_micro_batch(load: ImageLoad, tokens_per_batch: int) -> MicroBatch:
    """Examples of average length padded to the longest, as many as ``tokens_per_batch`` holds (at least one)."""
    budget = max(tokens_per_batch, load.longest)
    examples = max(1, min(load.examples, int(budget // max(1.0, load.tokens_per_example))))
    padded = min(budget, max(load.longest, round(examples * load.tokens_per_example / load.padding_efficiency)))
    images = examples * load.images_per_example
    return MicroBatch(examples, images, padded, round(images * load.image_tokens_per_image))


def image_recipe_estimate(
    config: RunConfig,
    model_config: Mapping[str, Any],
    family: VisionFamily,
    shape: Any,
    target: Any,
    load: ImageLoad,
) -> RecipeEstimate:
    """Predicted peak memory, steps and time of ``config`` training ``family``'s model on ``load`` on ``target``
    (a DeviceTarget or HardwareInfo)."""
    from engine.hardware.detect import HardwareInfo
    from engine.hardware.profile import DeviceTarget

    device = DeviceTarget.from_hardware(target) if isinstance(target, HardwareInfo) else target
    tokens_per_batch = config.data.tokens_per_batch or AUTOMATIC_TOKENS
    batch = planned_micro_batch(load, tokens_per_batch)
    max_pixels = config.vision.max_pixels or family.max_pixels
    budget = _budget(device)
    image_tokens = row_image_tokens(model_config, family, batch, max_pixels)

    def plan(checkpointing: Checkpointing) -> MemoryEstimate:
        setup = TrainSetup(
            tokens=max(1, batch.padded_tokens - batch.image_tokens), qlora=config.model.qlora,
            lora_rank=config.lora.sized().rank, checkpointing=checkpointing, dtype_bytes=2 if device.is_gpu else 4,
        )  # fmt: skip
        return vision_step_estimate(
            model_config, family, setup, images_per_row=math.ceil(batch.images), max_pixels=max_pixels,
            adapt_vision=config.vision.adapt_vision, image_tokens=image_tokens,
        )  # fmt: skip

    estimate = plan("none")  # as the run chooses its recompute (engine.run.vision_session)
    checkpointing: Checkpointing = "none"
    if choose_recompute(config.speed.checkpointing, device.is_gpu, estimate.peak, budget).on:
        checkpointing, estimate = "standard", plan("standard")
    steps = planned_image_steps(config, load, shape.total_params(), tokens_per_batch)
    if budget is None:
        return RecipeEstimate(True, None, None, steps, None, "no memory figure for this device", tokens_per_batch)
    if estimate.peak > budget:
        reason = (
            f"predicted {estimate.peak / GIB:.1f} GiB (the vision tower's {estimate.parts['vision_tower'] / GIB:.2f} "
            f"GiB and {batch.image_tokens:,} image tokens a micro-batch included) of {budget / GIB:.1f} GiB usable; "
            "lower vision.max_pixels or data.tokens_per_batch, or use QLoRA"
        )
        return RecipeEstimate(False, estimate.peak, budget, steps, None, reason, tokens_per_batch)
    step_tokens = batch_tokens(load, model_config, family, max_pixels, shape, config.vision.adapt_vision, batch)
    seconds = _seconds(config, shape, device, steps, step_tokens, checkpointing)
    return RecipeEstimate(True, estimate.peak, budget, steps, seconds, "", tokens_per_batch)


def row_image_tokens(model_config: Mapping[str, Any], family: VisionFamily, batch: MicroBatch, max_pixels: int) -> int:
    """The micro-batch's image tokens at ``max_pixels``: the Dataset page's count (made at the family's default
    budget) where the budget is no larger, never more than the budget allows; the budget's where it is larger
    (pictures the default shrank may then keep more of their pixels)."""
    at_budget = math.ceil(batch.images) * vision_memory(model_config, family, max_pixels, 2).image_tokens
    return min(batch.image_tokens, at_budget) if max_pixels <= family.max_pixels else at_budget


def batch_tokens(
    load: ImageLoad,
    model_config: Mapping[str, Any],
    family: VisionFamily,
    max_pixels: int,
    shape: Any,
    adapt_vision: bool,
    batch: MicroBatch,
) -> int:
    """A micro-batch's work in language-model tokens: its padded tokens, and the vision tower's passes over its
    images' patches (2 x tower parameters a patch forward, 6 with the tower adapted) as tokens of the same
    arithmetic (6 x language-model parameters a token)."""
    tower = vision_memory(model_config, family, max_pixels, 2)
    per_patch = (6 if adapt_vision else 2) * tower.tower_params
    tower_tokens = batch.images * tower.patches * per_patch / max(1, 6 * int(shape.total_params()))
    real = batch.examples * load.tokens_per_example
    return round(real / load.padding_efficiency + tower_tokens)


def planned_image_steps(config: RunConfig, load: ImageLoad, parameters: int, tokens_per_batch: int) -> int:
    """Steps the run takes: ``max_steps``, epochs over the padded micro-batches, or (automatic) what the run
    chooses for this many examples (engine.run.vision_session)."""
    training = config.training
    if training.max_steps > 0:
        return training.max_steps
    if training.epochs == 0:
        facts = FitFacts(
            examples=load.examples,
            tokens=round(load.examples * load.tokens_per_example),
            separate_held_out=bool(config.data.eval_path),
            parameters=parameters,
            instruct=False,
            method="sft",
            tokens_per_batch=tokens_per_batch,
            grad_accum=training.grad_accum,
        )
        return int(fit_to_data(facts).max_steps)
    per_batch = planned_micro_batch(load, tokens_per_batch).examples
    rows = math.ceil(load.examples / per_batch)
    return max(1, math.ceil(training.epochs * rows / training.grad_accum))


def _budget(device: Any) -> int | None:
    """What a run may allocate: the card's usable memory, or on a CPU the share of the computer's a run leaves
    itself (as engine.hardware.profile plans text runs)."""
    if not device.memory_bytes:
        return None
    if device.is_gpu:
        return usable_bytes(device.memory_bytes, integrated=device.integrated, other_used_bytes=device.other_used_bytes)
    return int(device.memory_bytes * 0.6)


def _seconds(
    config: RunConfig, shape: Any, device: Any, steps: int, step_tokens: int, checkpointing: str
) -> float | None:
    micro_batches = steps * config.training.grad_accum
    if not device.is_gpu:
        threads = max(1, device.cpu_cores - 1)  # one core stays with the window (engine.run.background)
        return micro_batches * cpu_step_seconds(shape, step_tokens, threads, config.model.qlora)
    from engine.hardware.profile import build_profile

    # the card's rate for the language model's rows (its figure per token barely moves with the row's length)
    overrides = {"qlora": config.model.qlora, "checkpointing": checkpointing}
    rate = build_profile(device, shape, overrides=overrides, lora_rank=config.lora.sized().rank).tokens_per_second
    return micro_batches * step_tokens / rate if rate else None


def image_estimate_for(config: RunConfig, shape: Any, target: Any, report: Any) -> RecipeEstimate | None:
    """:func:`image_recipe_estimate` where ``config``'s model is a vision-language model on this computer and
    ``report`` (a DatasetReport) an image dataset's; None otherwise (the text estimate applies)."""
    load = ImageLoad.from_report(report)
    if load is None or shape is None:
        return None
    from engine.vision.families import family_of, is_vision_config
    from engine.vision.model import model_config_dict  # loads torch: only once an image dataset was read

    model_config = model_config_dict(config.model, on_disk=True)
    if model_config is None or not is_vision_config(model_config):
        return None
    return image_recipe_estimate(config, model_config, family_of(model_config), shape, target, load)


PLAN_TEXT_TOKENS = 512
"""Text tokens beside the image in ``tunedeck plan``'s picture micro-batch, when ``--tokens-per-batch`` is not given."""


@dataclass(frozen=True)
class PicturePlan:
    """What pictures add to a plan (``tunedeck plan`` for a vision-language model), before any data is known."""

    family: str
    tower_params: int
    tower_bytes: int
    max_pixels: int
    image_tokens: int
    text_tokens: int
    peak_bytes: int
    budget_bytes: int | None

    def lines(self) -> list[str]:
        room = f" of {self.budget_bytes / GIB:.1f} GiB usable" if self.budget_bytes else ""
        verdict = "" if self.budget_bytes is None or self.peak_bytes <= self.budget_bytes else ": does not fit"
        return [
            f"Pictures ({self.family}):",
            f"  vision tower: {self.tower_params / 1e6:,.0f}M parameters, {self.tower_bytes / GIB:.2f} GiB of weights "
            "(frozen unless --adapt-vision)",
            f"  one image at {self.max_pixels:,} pixels (--max-pixels) adds {self.image_tokens:,} image tokens",
            f"  a micro-batch of one image and {self.text_tokens:,} text tokens peaks at about "
            f"{self.peak_bytes / GIB:.1f} GiB{room}{verdict}",
        ]


def picture_plan(
    model: str, device: Any, *, qlora: bool, lora_rank: int, checkpointing: str, max_pixels: int | None,
    text_tokens: int | None,
) -> PicturePlan | None:  # fmt: skip
    """The picture part of the plan for ``model`` (a folder or config.json path) on ``device`` (a DeviceTarget);
    None for a text model or a built-in shape."""
    from engine.hardware.shapes import load_shape
    from engine.vision.families import family_of, is_vision_config

    model_config = _config_file(model)
    if model_config is None or not is_vision_config(model_config):
        return None
    family = family_of(model_config)
    pixels = max_pixels or family.max_pixels
    setup = TrainSetup(
        tokens=text_tokens or PLAN_TEXT_TOKENS, qlora=qlora, lora_rank=lora_rank, checkpointing="none",
        dtype_bytes=2 if device.is_gpu else 4,
    )  # fmt: skip
    load_shape(model)  # the language model must plan too (a config without one is refused here, as for text)
    estimate = vision_step_estimate(model_config, family, setup, images_per_row=1, max_pixels=pixels)
    if choose_recompute(checkpointing, device.is_gpu, estimate.peak, _budget(device)).on:  # as a run chooses
        setup = replace(setup, checkpointing="standard")
        estimate = vision_step_estimate(model_config, family, setup, images_per_row=1, max_pixels=pixels)
    tower = vision_memory(model_config, family, pixels, setup.dtype_bytes)
    return PicturePlan(
        family.label, tower.tower_params, tower.tower_bytes, pixels, tower.image_tokens, setup.tokens, estimate.peak,
        _budget(device),
    )  # fmt: skip


def _config_file(model: str) -> dict[str, Any] | None:
    import json
    from pathlib import Path

    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    found = json.loads(path.read_text(encoding="utf-8"))
    return found if isinstance(found, dict) else None
