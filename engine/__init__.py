"""TuneDeck's training engine: headless, Qt-free, usable from the app, the command line or a script.

The folders are the layers. Each may import only layers listed above it, so dependencies run one way
(tests/test_engine_layers.py keeps it so):

1. errors, events, quiet, redact, demo, crash_guard: the error type, the events every long job reports, library
   noise, token redaction, the built-in demo task, native crashes kept from the window (and logged);
2. rewards: scoring a model's answers for training by reward (plain Python, no torch);
3. config: the one typed config tree (``from engine.config import RunConfig``), method_facts: what each training
   method packs, refuses and reports, known before any model loads;
4. data (files, tokenizing, packing), hardware (GPU detection, memory planner, telemetry), setup (installing
   torch, repairing the environment);
5. model (loading a base model with LoRA, chat), speed (the speed switches);
6. vision (vision-language models: families, image data, processors, image chat, what pictures cost in memory);
7. run (the training loop of one process: session, step, checkpoints, guard, control, schedule, run folder,
   registry, the training methods; image runs too), export (adapter and merged-model exports);
8. distributed (a run over several GPUs: torchrun launch, process group, control relay);
9. train: the public entry point, ``from engine.train import run``, on one process or several;
10. cli (the ``tunedeck`` commands, progress printer, demo run);
11. bench (the benchmark programs, which time the product through its own entry points; ``tunedeck bench``
    reaches them by name, so the command line never imports them).
"""
