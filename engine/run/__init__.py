"""One training run in one process: the loop, its session and step, the run folder, and what keeps it safe.

- engine.run.loop: steps, evaluations, checkpoints and the final adapter, as events (one process, or one rank);
- engine.run.session: starting a run (data, model with LoRA, optimizer, speed controller) or restoring one;
- engine.run.step: one optimizer step, out-of-memory retries, evaluation passes;
- engine.run.folder: the run folder's files (config.json, metrics.jsonl, eval.jsonl, adapter/);
- engine.run.checkpoint, engine.run.guard: atomic checkpoints, out-of-memory and non-finite-loss handling;
- engine.run.control, engine.run.schedule: stop/pause/speed requests between steps; the learning-rate schedule;
- engine.run.ranks: this process's share of a step among the ranks of a multi-GPU run (a no-op alone);
- engine.run.registry, engine.run.recorder: the run history (one SQLite index of every run), kept up to date
  from a run's events;
- engine.run.data_report: what a dataset gives a run with a model before it starts (format, bad rows, lengths,
  packing, a preview of the trained tokens).

The public entry point is :func:`engine.train.run`, which also starts multi-GPU runs (engine.distributed).
"""
