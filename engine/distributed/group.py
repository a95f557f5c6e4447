"""Joining the process group torchrun set up, and choosing how the ranks share the model (DDP or FSDP2)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from engine.distributed.nodes import RUN_ID, Place, store_client, take_place
from engine.errors import ConfigError
from engine.run.ranks import LONG_TIMEOUT, ParallelMode, Ranks


def init_ranks(device_request: str) -> tuple[Ranks, torch.device]:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on the CPU) plus a gloo group for control."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(device_request)
    dist.init_process_group(_backend(device), **_group_options(device))
    return Ranks(rank=rank, world=world, control_group=_control_group(device)), device


def init_node_ranks(device_request: str, join_timeout_s: float) -> tuple[Ranks, torch.device, Place]:
    """:func:`init_ranks` across computers: ranks ordered by (node rank, local rank), so global rank 0 is on node 0
    (engine.distributed.nodes)."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    store = store_client(join_timeout_s)
    place = take_place(store, int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = _device(device_request)
    group_store = dist.PrefixStore(f"{RUN_ID}/group", store)
    dist.init_process_group(
        _backend(device), store=group_store, rank=place.rank, world_size=world, **_group_options(device)
    )
    return Ranks(rank=place.rank, world=world, control_group=_control_group(device)), device, place


def _device(device_request: str) -> torch.device:
    if device_request != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _group_options(device: torch.device) -> dict[str, Any]:
    """NCCL binds the group to its GPU (and keeps its own timeout); gloo waits as long as a pause may last."""
    return {"device_id": device} if device.type == "cuda" else {"timeout": LONG_TIMEOUT}


def _control_group(device: torch.device) -> Any:
    import torch.distributed as dist

    if device.type == "cuda":
        return dist.new_group(backend="gloo", timeout=LONG_TIMEOUT)
    return dist.group.WORLD


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
