"""One rank of a multi-GPU run, as torchrun starts it: ``python -m engine.distributed.worker``.

The launcher passes the run (config, run folder, resuming or not) in the ``TUNEDECK_LAUNCH`` environment
variable. Every rank trains; rank 0 prints the run's events on stdout, each line marked so the launcher can tell
them from anything a library prints. A rank that fails says so on stderr and exits 1, which makes torchrun end
the others. A run over several computers goes on in :mod:`engine.distributed.node_worker`. Imports nothing from
Qt.
"""

from __future__ import annotations

import json
import os
import sys

from engine.config import RunConfig
from engine.distributed.group import init_ranks
from engine.distributed.launch import LAUNCH_ENV
from engine.distributed.rank import train_rank
from engine.hardware.allocator import set_at_process_start


def main() -> int:
    set_at_process_start()  # a rank's CUDA starts in init_ranks below
    import torch.distributed as dist

    from engine.quiet import quiet_libraries

    quiet_libraries()
    launch = json.loads(os.environ[LAUNCH_ENV])
    config = RunConfig.from_dict(launch["config"])
    if config.training.nodes > 1:
        from engine.distributed.node_worker import run_node

        return run_node(config, launch)
    ranks, device = init_ranks(config.training.device)
    failed = train_rank(config, launch, ranks, device, prints_events=ranks.is_main)
    if not failed:
        ranks.barrier()  # no rank tears down its connections while another still uses them
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
