"""What a run reports, as small frozen dataclasses.

A run is ``for event in run(config): ...``. The CLI prints these events, the app's worker thread re-emits them
as Qt signals, and the tests iterate them. Every event can be turned into a plain dict (``to_dict``) with its
``kind`` so that it can also be written as JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    """Base of every run event."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class RunStarted(Event):
    run_dir: str
    device: str
    dtype: str
    total_steps: int
    start_step: int
    train_examples: int
    eval_examples: int
    train_rows: int
    packing_efficiency: float
    trainable_params: int
    total_params: int
    estimated_s: float | None = None
    """The training time the run expects before its first step (None: not known until the first steps)."""
    estimate_basis: str = ""
    """What ``estimated_s`` rests on, in words ("from the planner's figure for this CPU")."""


@dataclass(frozen=True)
class Notice(Event):
    """Something the user should know that does not stop the run (dropped rows, a fallback taken)."""

    message: str


@dataclass(frozen=True)
class StepMetrics(Event):
    step: int
    total_steps: int
    epoch: float
    loss: float
    learning_rate: float
    grad_norm: float
    tokens: int
    trained_tokens: int
    step_time_s: float
    tokens_per_s: float
    memory_bytes: int
    """The step's true peak of GPU memory (bytes): the allocator's peak reserved memory, which counts step graphs'
    pool and cached blocks, not only live tensors (engine.hardware.vram); on CPU, the process's resident memory."""
    rank_memory_bytes: list[int] | None = None
    """With several GPUs: each rank's ``memory_bytes`` (``memory_bytes`` is then their maximum)."""
    driver_memory_bytes: int | None = None
    """This process's GPU memory as the driver (NVML) reports it when the step is read, CUDA context included;
    None where NVML cannot tell (no driver, not permitted, a CPU run)."""
    rank_busy_s: list[float] | None = None
    """With several GPUs: each rank's seconds of work in the step up to its gradients, its waits for the other ranks
    left out (engine.run.busy), so that a slower GPU or computer shows."""
    rewards_chosen: float | None = None
    """DPO runs (None otherwise): the mean over the step's pairs of beta × (policy − reference) log-probability of
    the chosen answer, TRL's ``rewards/chosen``; ``rewards_rejected`` the same for the rejected answer."""
    rewards_rejected: float | None = None
    reward_margin: float | None = None
    """DPO: mean of chosen minus rejected reward (TRL's ``rewards/margins``)."""
    reward_accuracy: float | None = None
    """DPO: share of the step's pairs whose chosen reward beats the rejected one (TRL's ``rewards/accuracies``)."""
    reward_mean: float | None = None
    """GRPO runs (None otherwise): the mean total reward of the answers the step trained on (TRL's ``reward``);
    ``reward_std`` their standard deviation (``reward_std``)."""
    reward_std: float | None = None
    reward_means: dict[str, float] | None = None
    """GRPO: each reward's mean score before its weight (TRL's ``rewards/NAME/mean``)."""
    completion_length: float | None = None
    """GRPO: the answers' mean length in tokens."""
    kl: float | None = None
    """GRPO with a KL penalty: mean KL to the base model per answer token (TRL's ``kl``)."""
    clip_fraction: float | None = None
    """GRPO: share of answer tokens whose probability ratio was clipped (TRL's ``clip_ratio/region_mean``)."""
    generation_tokens_per_s: float | None = None
    """GRPO: tokens sampled per second, on steps that sampled a new group (None on steps that reuse one)."""
    update_tokens_per_s: float | None = None
    """GRPO: prompt and answer tokens per second of the update pass alone (``tokens_per_s`` counts the sampling
    time too)."""


@dataclass(frozen=True)
class EvalMetrics(Event):
    step: int
    loss: float
    tokens: int
    reward_accuracy: float | None = None
    """DPO runs: share of held-out pairs whose chosen answer gets the higher reward (``loss`` is then the mean DPO
    loss over the pairs and ``tokens`` counts their answers' tokens)."""
    reward_mean: float | None = None
    """GRPO runs: the mean total reward of greedy answers to the held-out prompts (``loss`` is then its negative,
    so the best adapter is the one with the highest reward, and ``tokens`` counts the answers' tokens)."""


@dataclass(frozen=True)
class BestAdapterKept(Event):
    """An evaluation brought the lowest held-out loss so far: the adapter as it is now goes to ``path``
    (``adapter-best/``, written in the background)."""

    step: int
    eval_loss: float
    path: str


@dataclass(frozen=True)
class EvalRising(Event):
    """The held-out loss rose ``rises`` evaluations in a row: the model is likely overfitting its training data."""

    step: int
    eval_loss: float
    rises: int
    best_step: int
    best_eval_loss: float
    message: str


@dataclass(frozen=True)
class CheckpointSaved(Event):
    step: int
    path: str


@dataclass(frozen=True)
class RunFinished(Event):
    step: int
    run_dir: str
    adapter_dir: str
    final_loss: float | None
    eval_loss: float | None
    wall_time_s: float
    cancelled: bool = False
    best_adapter_dir: str | None = None
    """Runs with held-out data: the adapter of the lowest held-out loss, kept beside ``adapter_dir``."""
    best_step: int | None = None
    best_eval_loss: float | None = None
    stopped_early: bool = False
    """``training.early_stop`` evaluations in a row brought no lower held-out loss, so the run ended there."""


@dataclass(frozen=True)
class RunFailed(Event):
    message: str
    hint: str | None
    step: int
    run_dir: str | None


@dataclass(frozen=True)
class RunPaused(Event):
    """The run is holding between two steps with the model loaded."""

    step: int


@dataclass(frozen=True)
class RunResumed(Event):
    step: int


@dataclass(frozen=True)
class SpeedChanged(Event):
    """The speed optimizations in force from ``step`` on: each with its resolved choice and a one-line reason."""

    step: int
    state: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class AnswersSampled(Event):
    """GRPO: a few of the answers a step trained on, for the user to read: one prompt's group, each answer with its
    total reward (the app shows them beside the reward charts)."""

    step: int
    prompt: str
    answers: list[str]
    rewards: list[float]
    scores: dict[str, list[float]] | None = None
    """Each reward's score of each answer before its weight (``scores[name][i]`` for ``answers[i]``), in the
    order the rewards were built; ``rewards`` are their weighted sums."""


@dataclass(frozen=True)
class OomRecovered(Event):
    """A step ran out of accelerator memory; memory was released and the step is retried with less.

    ``action`` is ``"retry"`` (cached memory released, the same settings again: the first answer to a shortage),
    ``"resident_layers"`` or ``"step_graphs"`` (the memory those switches hold is given back for now),
    ``"tokens_per_batch"`` (packed rows are split into smaller micro-batches of at most
    ``tokens_per_batch`` tokens, same documents in the same order), ``"offloaded_checkpointing"`` or
    ``"chunked_mlp"`` (the MLPs run over chunks of the sequence in the recompute); a picture run's
    ``"tokens_per_batch"`` splits its padded micro-batches, and its ``"recompute"`` turns on activation checkpointing.
    """

    step: int
    action: str
    tokens_per_batch: int
    message: str


@dataclass(frozen=True)
class SpeedRestored(Event):
    """A setting an out-of-memory step lowered is tried again from ``step`` on: the steps since left memory to spare.

    ``action`` names it as :class:`OomRecovered` did (``"resident_layers"``, ``"step_graphs"``,
    ``"tokens_per_batch"``, ``"offloaded_checkpointing"``, ``"chunked_mlp"``).
    """

    step: int
    action: str
    message: str


@dataclass(frozen=True)
class StepSkipped(Event):
    """An update was skipped because the loss or gradient norm was not finite; the weights are unchanged."""

    step: int
    loss: float
    grad_norm: float
    consecutive: int
    total_skipped: int


@dataclass(frozen=True)
class NodeFigures(Event):
    """A run over several computers, after a step: each node's devices, busy seconds of the step (its slowest rank's
    ``StepMetrics.rank_busy_s``) and peak memory (its largest rank's), index = node rank; which node is slowest."""

    step: int
    devices: list[str]
    step_time_s: list[float]
    memory_bytes: list[int]
    slowest: int
    slower_by_s: float
    """How much longer the slowest node worked on the step than the fastest one."""
