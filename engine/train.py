"""The training run: ``for event in run(config): ...``.

A run prepares the data, loads the base model with a fresh LoRA adapter (or restores one from a checkpoint),
then takes optimizer steps over packed rows, reporting each as an event. Between two steps it obeys its
:class:`~engine.run.control.RunControl` (stop, pause, new speed settings). Everything a user keeps lands in the
run folder: ``config.json``, ``metrics.jsonl``, ``eval.jsonl``, ``checkpoints/`` and the final ``adapter/``.
Failures end the iterator with a :class:`~engine.events.RunFailed` event instead of an exception.

Reliability (see engine.run.guard and engine.run.checkpoint): an out-of-memory step is retried with smaller
micro-batches or offloaded checkpointing; a non-finite loss skips the update; checkpoints, the adapter and
config.json are written atomically and the logs are fsynced before each checkpoint, so a kill at any moment
resumes from a consistent state; a failed write stops the run with a message naming the disk problem. Nothing a
run reports or writes contains the Hugging Face token (engine.redact).

This module is the public entry point and sits above both ways to train: one process
(:func:`engine.run.loop.train_in_process`) or, when ``training.gpus`` names several GPUs, the ranks under
torchrun (:func:`engine.distributed.launch.run_ranks`), whose rank 0's events it yields; with ``training.nodes``
above 1 the ranks of several computers form one run (engine.distributed.nodes), node 0 keeping the run folder.
engine.distributed says what a step means with W ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from engine.config import RunConfig
from engine.distributed.launch import join_run, resolve_gpus, run_ranks
from engine.errors import ConfigError
from engine.events import Event
from engine.hardware.allocator import apply_at_run_start
from engine.redact import known_tokens, redact_event
from engine.run.control import RunControl
from engine.run.folder import load_run_config, new_run_dir
from engine.run.loop import failure, on_one_gpu, resumed_config, train_in_process
from engine.run.vision_loop import train_vision
from engine.vision.model import vision_family

__all__ = ["run", "run_beside_window"]


def run(config: RunConfig, *, control: RunControl | None = None, resume: str | Path | None = None) -> Iterator[Event]:
    """Train a LoRA adapter, yielding events; ``resume`` continues the run in that folder from its last checkpoint."""
    tokens = known_tokens()
    for event in _run(config, control, resume):
        yield redact_event(event, tokens)


def _run(config: RunConfig, control: RunControl | None, resume: str | Path | None) -> Iterator[Event]:
    # Packed rows change length every step: without expandable segments the allocator fragments (engine.hardware
    # .allocator). Through the settings API where CUDA is already up, so the window's run gets them too.
    apply_at_run_start()
    control = control or RunControl()
    run_dir: Path | None = None
    try:
        if resume is not None:
            run_dir = Path(resume)
            config = resumed_config(load_run_config(run_dir), config)
        gpus = resolve_gpus(config.training.gpus, config.training.device)
        family = vision_family(config.model)  # a vision-language model trains in engine.vision
        if family is not None and (len(gpus) > 1 or config.training.nodes > 1):
            raise ConfigError("vision-language models train on one GPU", hint="pass --gpus 1")
        if config.training.node_rank > 0:  # node 0 keeps the run folder; this computer joins its run
            yield from join_run(config, gpus, control)
            return
        if config.training.nodes == 1:
            config = on_one_gpu(config, gpus)
        if run_dir is None:
            run_dir = new_run_dir(config)
        if len(gpus) > 1 or config.training.nodes > 1:
            yield from run_ranks(config, run_dir, resume is not None, gpus, control)
            return
    except Exception as err:  # the user gets a message and a log, never a dead app
        yield failure(err, None, run_dir, write_log=True)
        return
    if family is not None:
        yield from train_vision(config, run_dir, resume is not None, control, family)
        return
    yield from train_in_process(config, run_dir, resume is not None, control)


def run_beside_window(config: RunConfig, control: RunControl, resume: str | Path | None = None) -> Iterator[Event]:
    """:func:`run` as the window's training thread runs it (app.background.worker): the CPU shared with the GUI thread
    (engine.run.background), libraries' chatter quieted, and every event recorded in the run history so the Runs
    page lists the run. Qt-free, so a benchmark takes the window's path in the same order without a window."""
    import torch

    from engine.quiet import quiet_libraries
    from engine.run.background import lower_thread_priority, open_run_history, training_threads
    from engine.run.recorder import recorded

    torch.set_num_threads(training_threads())
    lower_thread_priority()
    quiet_libraries()
    yield from recorded(run(config, control=control, resume=resume), open_run_history())
