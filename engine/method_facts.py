"""What the planner, the automatic settings and the session know of each training method before any model loads:
a table, importable without torch (engine.hardware reads it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SEVERAL_GPUS = "several_gpus"
STEP_GRAPHS = "step_graphs"
FUSED_LOSS = "fused_loss"
LATE_READOUT = "late_readout"
KEEP_KNOWLEDGE = "keep_knowledge"
PACKING = "packing"
IMAGES = "images"
SWITCHES = (SEVERAL_GPUS, STEP_GRAPHS, FUSED_LOSS, LATE_READOUT, KEEP_KNOWLEDGE, PACKING, IMAGES)
"""What a method may refuse: training over several GPUs, the step graphs, the fused loss, late step readout, the
knowledge-keeping replay of the base model's answers (engine.run.replay), and packing several documents into a
row (a method that refuses it prepares one item a row), and vision-language models' image rows."""


@dataclass(frozen=True)
class MethodFacts:
    """One method's fixed facts."""

    name: str
    title: str
    """The method's name in messages ("DPO")."""
    pairs: bool = False
    """It trains on preference pairs, and only it does."""
    report: str = "documents"
    """Which section of the before/after report measures its runs (engine.run.report.SECTIONS)."""
    documents_per_item: int = 1
    """Documents one item packs as (a preference pair's two answers share a row)."""
    visits_share: float = 1.0
    """Automatic passes over the data: this share of supervised tuning's visits per example."""
    rate_share: float = 1.0
    """Automatic learning rate: this share of supervised tuning's."""
    rate_note: str = ""
    """Why the automatic rate is a share, as the automatic settings' notice words it (empty: the full rate)."""
    refusals: Mapping[str, str] = field(default_factory=dict)
    """Switches (``SWITCHES``) the method cannot train with, and why."""


FACTS = {
    "sft": MethodFacts("sft", "supervised tuning"),
    "dpo": MethodFacts(
        "dpo",
        "DPO",
        pairs=True,
        report="pairs",
        documents_per_item=2,
        visits_share=0.5,  # preferences move a model that already answers
        rate_share=0.25,
        rate_note="a quarter for preference tuning",
        refusals={
            SEVERAL_GPUS: "DPO trains on one GPU",
            STEP_GRAPHS: "a DPO step may run a reference pass beside its micro-batch",
            FUSED_LOSS: "DPO scores answers by their log-probabilities: logits only at answer tokens instead",
            LATE_READOUT: "DPO reads the step's rewards with its loss",
            KEEP_KNOWLEDGE: "DPO measures against a reference model, which already holds the tuned model near it",
            IMAGES: "DPO is not available for vision-language models",
        },
    ),
    "grpo": MethodFacts(
        "grpo",
        "GRPO",
        report="rewards",
        visits_share=0.5,  # each visit samples a whole group of answers
        rate_share=1 / 3,
        rate_note="a third for learning from rewards (a policy update moves every sampled answer)",
        refusals={
            SEVERAL_GPUS: "GRPO trains on one GPU: its answers are sampled in the training process",
            STEP_GRAPHS: "each GRPO step samples answers of new lengths between its updates",
            FUSED_LOSS: "the clipped objective needs each answer token's log-probability: logits only at answer "
            "tokens instead",
            LATE_READOUT: "GRPO reads the step's rewards, KL and clip fraction with its loss",
            KEEP_KNOWLEDGE: "GRPO learns from the model's own sampled answers, with no written answers to mix "
            "replay into (a KL penalty, --beta, holds it near the base instead)",
            PACKING: "sampled answers train as padded batches of one prompt's group, each answer in its own row",
            IMAGES: "GRPO is not available for vision-language models",
        },
    ),
}


def facts_for(method: str) -> MethodFacts:
    """The facts of ``training.method`` ``method``."""
    try:
        return FACTS[method]
    except KeyError:
        raise ValueError(f"unknown training method {method!r}; known: {', '.join(FACTS)}") from None
