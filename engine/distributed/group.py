"""Joining the process group torchrun set up, and choosing how the ranks share the model (DDP or FSDP2)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from engine.errors import ConfigError
from engine.run.ranks import LONG_TIMEOUT, ParallelMode, Ranks


def init_ranks(device_request: str) -> tuple[Ranks, torch.device]:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on the CPU) plus a gloo group for control."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_request != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        control = dist.new_group(backend="gloo", timeout=LONG_TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=LONG_TIMEOUT)
        control = dist.group.WORLD
    return Ranks(rank=rank, world=world, control_group=control), device


def choose_mode(ranks: Ranks, config: Any, device: torch.device) -> Ranks:
    """DDP or FSDP2 as requested; ``auto`` asks the planner (engine.hardware.parallel)."""
    requested = config.training.parallel
    if requested == "fsdp" or requested == "ddp":
        mode, reason = requested, f"{'FSDP2' if requested == 'fsdp' else 'DDP'} requested"
    else:
        mode, reason = _auto_mode(config, ranks.world, device)
    if mode == "fsdp" and config.model.qlora:
        raise ConfigError(
            "QLoRA cannot train under FSDP2: 4-bit weights are not sharded", hint="use --parallel ddp with --qlora"
        )
    return dataclasses.replace(ranks, mode=mode, reason=reason)


def _auto_mode(config: Any, world: int, device: torch.device) -> tuple[ParallelMode, str]:
    if device.type != "cuda":
        return "ddp", "auto: DDP"
    from engine.hardware.parallel import choose_for_run
    from engine.hardware.planner import usable_bytes
    from engine.speed.offloaded_checkpoint import offload_unsupported_reason

    properties = torch.cuda.get_device_properties(device)
    can_offload = offload_unsupported_reason(device) is None
    plan = choose_for_run(config, world, usable_bytes(properties.total_memory), can_offload=can_offload)
    mode: ParallelMode = "fsdp" if plan.mode == "fsdp" else "ddp"
    return mode, plan.reason
