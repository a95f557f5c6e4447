"""Train on my preferences: a DPO run on the pairs saved for a run's base model, from that run's adapter.

The pairs (engine.data.preferences) are frozen into a snapshot file first, so pairs saved while the run trains do not
change what it reads, and the run config says which file it trained on. Its settings are the run's own model, LoRA,
speed and device settings, DPO's default beta and loss, and a few passes at a modest learning rate: a handful of
pairs makes a handful of steps.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path

from engine.config import DataConfig, DpoConfig, OutputConfig, RunConfig, TrainingConfig
from engine.data.preferences import PreferenceError, PreferenceStore, missing_pairs
from engine.model.adapter import run_adapter

SNAPSHOTS_DIR = "snapshots"
"""Under the preferences folder: the frozen copy of the pairs each "train on my preferences" run reads, a folder
each holding ``SNAPSHOT_FILE``."""
SNAPSHOT_FILE = "preferences.jsonl"
HELD_OUT_FROM = 20
"""From this many pairs on, the DPO run holds the default share out to measure reward accuracy; below it every
pair trains (a held-out split of a handful of pairs measures nothing)."""
DPO_LEARNING_RATE = 5e-5
DPO_EPOCHS = 3.0
"""A few pairs make a few steps: three passes over them, at a quarter of the supervised default learning rate
(DPO moves a model already tuned on the task), with no warm-up that would take up most of the run."""


def preference_run_config(run_folder: str | Path, data: str | Path, pairs: int, adapter: str = "best") -> RunConfig:
    """A DPO run on ``data`` (``pairs`` exported pairs) that starts from the run's ``adapter`` (best or last) on
    its base model: the run's model, LoRA, speed and device settings, DPO's default beta and loss, a few passes
    at a modest learning rate (``DPO_LEARNING_RATE``, ``DPO_EPOCHS``), written beside the run's folder."""
    folder = Path(run_folder)
    source = RunConfig.load(folder / "config.json")
    chosen = run_adapter(folder, adapter)
    if chosen is None:
        raise PreferenceError(
            f"{folder.name} has no adapter yet", hint="a run writes its adapter when it finishes or is stopped"
        )
    training = TrainingConfig(
        method="dpo", epochs=DPO_EPOCHS, learning_rate=DPO_LEARNING_RATE, warmup_steps=0,
        seed=source.training.seed, device=source.training.device, gpus=source.training.gpus,
        parallel=source.training.parallel, optimizer=source.training.optimizer,
    )  # fmt: skip
    held_out = None if pairs >= HELD_OUT_FROM else 0.0  # None: the automatic share
    return RunConfig(
        model=dataclasses.replace(source.model, adapter=str(chosen.folder)),
        data=DataConfig(path=str(data), format="preference", eval_fraction=held_out),
        lora=source.lora,
        training=training,
        speed=source.speed,
        dpo=DpoConfig(),
        output=OutputConfig(dir=str(folder.parent), keep_checkpoints=source.output.keep_checkpoints),
    )


def train_on_preferences(run_folder: str | Path, adapter: str = "best", folder: Path | None = None) -> RunConfig:
    """The config of "train on my preferences": the pairs saved for the run's base model, frozen into a snapshot
    file (later pairs do not change what this run read), and a DPO run from the run's adapter on them. Refused
    with fewer than ``MIN_PAIRS`` pairs, saying how many more are needed."""
    store = PreferenceStore.for_run(run_folder, folder)
    count = store.count()
    short = missing_pairs(count)
    if short is not None:
        raise PreferenceError(f"{count} preferences saved for {store.label}: {short}")
    # named preferences.jsonl, so the run's default name reads <time>-<model>-preferences
    snapshot = store.folder / SNAPSHOTS_DIR / f"{store.path.stem}-{datetime.now():%Y%m%d-%H%M%S-%f}" / SNAPSHOT_FILE
    store.export(snapshot)
    return preference_run_config(run_folder, snapshot, count, adapter)
