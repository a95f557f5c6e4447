"""``tunedeck plan``: the planner's command (engine.hardware.cli) with what a vision-language model's pictures add
(engine.vision.recipe): the vision tower's weights, the image tokens of one picture at the pixel budget, and the
peak of a micro-batch of one picture."""

from __future__ import annotations

import argparse
from typing import Any

from engine.hardware import cli as hardware_cli


def plan_main(argv: list[str] | None = None) -> int:
    return hardware_cli.plan_main(argv, pictures_for=picture_plan)


def picture_plan(args: argparse.Namespace, device: Any, profile: Any) -> Any:
    """What a vision-language model's pictures add, None for a text model."""
    from engine.vision.recipe import picture_plan as plan_pictures

    plan = profile.memory_plan
    qlora = bool(args.qlora if args.qlora is not None else plan is not None and plan.qlora)
    return plan_pictures(args.model, device, qlora=qlora, lora_rank=args.lora_rank, checkpointing=args.checkpointing,
                         max_pixels=args.max_pixels, text_tokens=args.tokens)  # fmt: skip
