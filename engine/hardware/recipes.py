"""Recipes: a few named starting points that set the settings a hobbyist cares about, in plain words.

A recipe sets how long to train, the longest example, the adapter's size, the learning rate and how often to
evaluate and save; everything else keeps its value (the model, the dataset, the speed switches, the output
folder). Every recipe sets the same keys (:data:`RECIPE_KEYS`, defaults where it has no opinion), so switching
from one to another never leaves a value of the first behind. :func:`estimate_recipe` asks the memory planner
what a recipe costs on a card: the predicted peak memory, and the time from the card's throughput. Qt-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.config import RunConfig
from engine.hardware.fit_to_data import MEMORY_RANK, FitFacts, fit_to_data
from engine.hardware.row_lengths import GPU_TOKENS_PER_BATCH, choose_row_lengths, cpu_step_seconds
from engine.method_facts import facts_for


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    """One sentence in plain words: what it is for and what it costs."""
    settings: Mapping[str, Any]
    """'section.field' -> value."""
    demo_only: bool = False
    """Offered only with the demo model (its settings suit that tiny model and task)."""


DEMO_RECIPE = "Demo"
AUTOMATIC_RECIPE = "Automatic"
RECIPES: tuple[Recipe, ...] = (
    Recipe(
        AUTOMATIC_RECIPE,
        "Fitted to your data and model when the run starts: several passes over a small set with a held-out share "
        "to keep the best adapter and stop early, one pass over a large one; keeps what the model knew.",
        {},
    ),
    Recipe(
        DEMO_RECIPE,
        "The demo task's settings: 60 steps with a high learning rate; about a minute on a CPU.",
        {
            "data.max_seq_len": 128,
            "data.tokens_per_batch": 1024,
            "data.eval_fraction": 0.02,
            "training.max_steps": 60,
            "training.learning_rate": 2e-3,
            "training.warmup_steps": 5,
            "training.eval_every": 0,
            "training.save_every": 20,
            "training.keep_knowledge": False,
        },
        demo_only=True,
    ),
    Recipe(
        "Quick test",
        "Up to 30 steps (never more than one pass over your data) with a small adapter: checks that the model, "
        "the data and the card work together, in minutes.",
        {
            "training.max_steps": 30,
            "lora.rank": 8,
            "lora.alpha": 16.0,
            "training.eval_every": 0,
            "training.save_every": 0,
        },
    ),
    Recipe(
        "Balanced",
        "One pass over your data with a medium adapter, evaluated and saved every 50 steps: the usual choice.",
        {"training.epochs": 1.0, "training.eval_every": 50, "training.save_every": 50},
    ),
    Recipe(
        "Long context",
        "Examples of up to 8,192 tokens in one row, for long documents or chats; the planner picks checkpointing "
        "to make them fit, which costs some speed.",
        {
            "data.max_seq_len": 8192,
            "data.tokens_per_batch": 8192,
            "training.epochs": 1.0,
            "training.eval_every": 50,
            "training.save_every": 50,
        },
    ),
    Recipe(
        "Best quality",
        "Three passes with a larger adapter and a gentler learning rate: the best results, three times as long.",
        {
            "training.epochs": 3.0,
            "lora.rank": 32,
            "lora.alpha": 64.0,
            "training.learning_rate": 1e-4,
            "training.eval_every": 100,
            "training.save_every": 100,
        },
    ),
)
RECIPE_KEYS: tuple[str, ...] = tuple(sorted({key for recipe in RECIPES for key in recipe.settings}))
"""Every key some recipe sets; each recipe sets all of them (the defaults where it has no opinion)."""


def find_recipe(name: str) -> Recipe:
    for recipe in RECIPES:
        if recipe.name == name:
            return recipe
    raise KeyError(f"no recipe named {name!r}; recipes: {', '.join(r.name for r in RECIPES)}")


def recipe_values(recipe: Recipe) -> dict[str, Any]:
    """All of :data:`RECIPE_KEYS` for ``recipe``: its own values, the config's defaults for the rest."""
    defaults = RunConfig().to_dict()
    values = {}
    for key in RECIPE_KEYS:
        section, name = key.split(".")
        values[key] = recipe.settings.get(key, defaults[section][name])
    return values


def apply_recipe(config: RunConfig, recipe: Recipe) -> RunConfig:
    """A copy of ``config`` with the recipe's keys set (checked by the config, like any setting)."""
    raw = config.to_dict()
    for key, value in recipe_values(recipe).items():
        section, name = key.split(".")
        raw[section][name] = value
    return RunConfig.from_dict(raw)


@dataclass(frozen=True)
class RecipeEstimate:
    """What the planner predicts for a run with these settings on one card."""

    fits: bool
    peak_bytes: int | None
    budget_bytes: int | None
    steps: int | None
    """Optimizer steps (None: epochs over a dataset that is not known yet)."""
    seconds: float | None
    """Training time from the card's throughput, on a CPU from its step time (None: no figure for this device, or
    steps unknown)."""
    reason: str = ""
    tokens_per_batch: int = 0
    """The tokens of one packed row the estimate is for (an automatic value resolved for the device)."""


def planned_steps(
    config: RunConfig, dataset_tokens: int | None, dataset_examples: int | None = None, parameters: int | None = None
) -> int | None:
    """Steps the run takes: ``max_steps``, epochs over ``dataset_tokens`` in packed rows, or (both automatic) what
    :func:`engine.hardware.fit_to_data.fit_to_data` chooses for the dataset."""
    training = config.training
    if training.max_steps > 0:
        return training.max_steps
    if not dataset_tokens:
        return None
    tokens_per_batch = config.data.tokens_per_batch or GPU_TOKENS_PER_BATCH
    if training.epochs == 0:
        if not dataset_examples:
            return None
        facts = FitFacts(dataset_examples, dataset_tokens, bool(config.data.eval_path), parameters, True,
                         training.method, tokens_per_batch, training.grad_accum)  # fmt: skip
        return fit_to_data(facts).max_steps
    rows = math.ceil(dataset_tokens / tokens_per_batch)
    return max(1, math.ceil(training.epochs * rows / training.grad_accum))


def cpu_training_seconds(config: RunConfig, shape: Any, steps: int, cpu_cores: int) -> float:
    """The steps' time on a CPU at the planner's step time for the model and the row, with the threads a run
    started from the app trains with (all cores but one)."""
    threads = max(1, cpu_cores - 1)  # engine.run.background.training_threads: one core stays with the window
    step_s = cpu_step_seconds(shape, config.data.tokens_per_batch, threads, config.model.qlora)
    return steps * config.training.grad_accum * step_s


def estimate_recipe(
    config: RunConfig, shape: Any, target: Any, dataset_tokens: int | None = None, dataset_examples: int | None = None
) -> RecipeEstimate:
    """Predicted peak memory and time of ``config`` for ``shape`` on ``target`` (a DeviceTarget or HardwareInfo);
    an automatic row length or tokens per batch is the one a run on ``target`` would choose."""
    from engine.hardware.detect import HardwareInfo
    from engine.hardware.profile import DeviceTarget, build_profile

    device = DeviceTarget.from_hardware(target) if isinstance(target, HardwareInfo) else target
    rows = choose_row_lengths(
        on_gpu=device.is_gpu,
        max_seq_len=config.data.max_seq_len,
        tokens_per_batch=config.data.tokens_per_batch,
        shape=shape,
        cpu_cores=device.cpu_cores,
        qlora=config.model.qlora,
        documents_per_item=facts_for(config.training.method).documents_per_item,
    )
    data = dataclasses.replace(config.data, max_seq_len=rows.max_seq_len, tokens_per_batch=rows.tokens_per_batch)
    config = dataclasses.replace(config, data=data)

    overrides: dict[str, Any] = {"qlora": config.model.qlora, "tokens_per_batch": config.data.tokens_per_batch}
    if config.speed.checkpointing != "auto":
        overrides["checkpointing"] = config.speed.checkpointing
    if config.speed.chunked_mlp is not None:
        overrides["chunked_mlp"] = config.speed.chunked_mlp
    profile = build_profile(
        target,
        shape,
        overrides=overrides,
        lora_rank=config.lora.rank or MEMORY_RANK,
        min_tokens=config.data.max_seq_len,
    )
    plan = profile.memory_plan
    steps = planned_steps(config, dataset_tokens, dataset_examples, shape.total_params())
    if plan is None:
        return RecipeEstimate(True, None, None, steps, None, "no memory figure for this device", rows.tokens_per_batch)
    if not plan.fits:
        reason = plan.reasons.get("fit", "does not fit").removeprefix("does not fit: ")
        return RecipeEstimate(False, plan.estimate.peak, plan.budget_bytes, steps, None, reason, rows.tokens_per_batch)
    rate = profile.tokens_per_second
    tokens = None if steps is None else steps * config.data.tokens_per_batch * config.training.grad_accum
    seconds = tokens / rate if tokens and rate else None
    if not device.is_gpu and steps:
        seconds = cpu_training_seconds(config, shape, steps, device.cpu_cores)
    return RecipeEstimate(True, plan.estimate.peak, plan.budget_bytes, steps, seconds, "", rows.tokens_per_batch)


GIB = 1 << 30


def describe_peak(estimate: RecipeEstimate) -> str:
    """The predicted peak as every page words it, "0.1 of 14.1 GiB" ("" without a figure)."""
    if estimate.peak_bytes is None or not estimate.budget_bytes:
        return ""
    return f"{estimate.peak_bytes / GIB:.1f} of {estimate.budget_bytes / GIB:.1f} GiB"


def automatic_estimate(shape: Any, target: Any, qlora: bool = False) -> RecipeEstimate:
    """What the Automatic recipe costs for ``shape`` on ``target``: the figure the gallery and the Model page show
    for a model before a recipe is chosen (the Recipe page shows the same one beside "Automatic")."""
    config = RunConfig()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, qlora=qlora))
    return estimate_recipe(apply_recipe(config, find_recipe(AUTOMATIC_RECIPE)), shape, target)
