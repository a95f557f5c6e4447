"""One run on several GPUs through PyTorch's own distributed engine: torchrun, DDP or FSDP2.

``tunedeck train --gpus 2`` (or ``run(config)`` with ``training.gpus`` naming more than one GPU) starts
``python -m torch.distributed.run`` with one process per GPU (:mod:`engine.distributed.launch`); each process
runs the same training loop as a single-GPU run (:mod:`engine.run.loop`) with a :class:`~engine.run.ranks.Ranks`
telling it its share. Rank 0 streams the run's events back to the launching process, which yields them as if the
run were local, so the CLI, the run registry and the app see no difference.

``--nodes 2 --node-rank R --rendezvous HOST:PORT`` spans computers with the same launcher and worker: torchrun meets
the other nodes through its c10d rendezvous, every node is checked against node 0 before the first step, and a node
watch stops the run when a computer goes (:mod:`engine.distributed.nodes`, ``preflight``, ``joined``, ``watch``).
The step contract below holds unchanged, W counting the GPUs of every node.

What a step means with W ranks (the contract the tests check against a one-process run):

- ``training.grad_accum`` stays the number of packed rows in one optimizer step: the GLOBAL batch. Rank r
  trains on the step's rows r, r+W, r+2W, ...; ranks run the same number of forward/backward passes, a rank
  with fewer rows padding with a pass whose labels are all ignored (zero loss, zero gradient), so the
  collectives of DDP and FSDP2 always pair up. ``data.tokens_per_batch`` is per GPU, as before.
- Every rank divides its loss by the step's GLOBAL count of trained tokens, which each rank computes on the host
  from the rows (no communication); the loss is multiplied by W before backward to undo DDP's (and FSDP2's)
  gradient averaging, so the summed gradient equals the one-process gradient of the same rows.
- The data position (``micro_batches``) counts global rows, so a checkpoint resumes with the same or a different
  number of GPUs and continues the same loss curve (up to float reduction order). Each document is seen once
  per epoch.
- One small all-reduce per step on a gloo group carries the step's loss (sum of the ranks' shares), each
  rank's peak memory and its busy time (engine.run.busy); no device-to-host sync is added. Only rank 0
  writes the run folder; the others wait at a gloo barrier while it does, so a checkpoint is whole before anyone
  continues.
- Stop, pause and speed changes reach the ranks through a control file in the run folder that rank 0 reads
  between steps and broadcasts, so every rank acts at the same step.

Limits: with LoRA dropout the ranks draw their own masks, so only a dropout-free run matches one process
exactly; an out-of-memory step ends a multi-GPU run (the other ranks are already waiting in that step's
collectives) instead of being retried smaller; FSDP2 loads the base model into each rank's host memory before
sharding it to the GPUs, refuses float16 loss scaling and 4-bit QLoRA, and fixes automatic checkpointing to
standard recompute on GPUs (a per-GPU choice could differ between ranks, and their collectives would then
never pair up).
"""
