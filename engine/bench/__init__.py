"""Benchmark programs, run on a GPU machine; nothing in the training path imports them.

- engine.bench.speed: ``tunedeck bench`` (``python -m engine.bench``): stock transformers+PEFT against each
  speed optimization, on one GPU;
- engine.bench.long_context: how long a row each set of switches trains before memory runs out;
- engine.bench.qlora: ``tunedeck bench --qlora``, 4-bit 7-8B models under 8 and 24 GiB caps;
- engine.bench.multi_gpu: a step's time and memory over several GPUs under DDP;
- engine.bench.memory: what is alive at a step's memory peak, and where it was allocated.
"""
