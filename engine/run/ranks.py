"""A training process's place among the ranks of a multi-GPU run, and the few collectives a step needs.

A one-process run holds :meth:`Ranks.single`, for which every method here is a no-op, so the training loop has
one code path. Joining the process group and choosing DDP or FSDP2 is engine.distributed.group's work; see
:mod:`engine.distributed` for what a step means with W ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from engine.errors import ConfigError
from engine.run.busy import GradientClock

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

ParallelMode = Literal["single", "ddp", "fsdp"]
LONG_TIMEOUT = timedelta(days=7)
"""Gloo collectives wait this long: a paused run keeps its ranks waiting in a broadcast, maybe overnight."""
FAULT_ENV = "TUNEDECK_FAULT_RANK_STEP"
"""Tests only: ``"RANK:STEP"`` makes that rank exit abruptly (``os._exit(3)``) when it reaches that step."""


class LossModule(torch.nn.Module):
    """The module DDP and FSDP2 wrap: its forward runs ``compute(model)`` and returns the loss.

    The fused loss calls the decoder and the output head directly instead of the model's forward; calling it
    from inside this module's forward is what lets DDP's and FSDP2's hooks see every micro-batch.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, compute: Callable[[torch.nn.Module], torch.Tensor]) -> torch.Tensor:
        return compute(self.model)


@dataclass(frozen=True)
class Ranks:
    """This process's rank among ``world`` training processes, and how the model is spread over them."""

    rank: int = 0
    world: int = 1
    mode: ParallelMode = "single"
    reason: str = "one process"
    control_group: Any = None
    """The gloo process group for control, metrics and barriers (never blocks the host on NCCL)."""
    clock: GradientClock = field(default_factory=GradientClock, compare=False, repr=False)
    """When this rank's gradients were ready in the step (DDP's hook), for its busy time (engine.run.busy)."""

    @classmethod
    def single(cls) -> Ranks:
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # --- the step's share -----------------------------------------------------------------------------------

    def share(self, items: list[Any]) -> list[Any]:
        """This rank's items of a step: r, r+W, r+2W, ..."""
        return items[self.rank :: self.world]

    def passes(self, counts_per_item: list[int]) -> int:
        """Forward/backward passes every rank runs: the most any rank needs for its share of the items."""
        return max(sum(counts_per_item[r :: self.world]) for r in range(self.world)) if counts_per_item else 0

    def accumulating(self, module: torch.nn.Module | None, last: bool) -> AbstractContextManager[Any]:
        """Gradients stay local for all but a rank's last micro-batch of a step, then are reduced once."""
        if self.mode == "fsdp" and module is not None:
            cast("FSDPModule", module).set_requires_gradient_sync(last)  # fully_shard made it one
            return nullcontext()
        if self.mode == "ddp" and module is not None and not last:
            return cast("DistributedDataParallel", module).no_sync()
        return nullcontext()

    @property
    def loss_scale(self) -> int:
        """Multiplies each rank's loss before backward, undoing the gradient averaging of DDP and FSDP2."""
        return self.world

    # --- collectives on the gloo group ----------------------------------------------------------------------

    def reduce_step(self, loss: float, memory_bytes: int) -> tuple[float, list[int] | None]:
        """The step's loss (sum of the ranks' shares) and every rank's peak memory; one small all-reduce."""
        loss, memory, _ = self.reduce_step_figures(loss, memory_bytes, 0.0)
        return loss, memory

    def reduce_step_figures(
        self, loss: float, memory_bytes: int, busy_s: float
    ) -> tuple[float, list[int] | None, list[float] | None]:
        """:meth:`reduce_step` plus every rank's busy time (engine.run.busy) in the same all-reduce:
        1 + 2W float64 values, a few dozen bytes a step."""
        if not self.distributed:
            return loss, None, None
        import torch.distributed as dist

        values = torch.zeros(1 + 2 * self.world, dtype=torch.float64)
        values[0] = loss
        values[1 + self.rank] = memory_bytes
        values[1 + self.world + self.rank] = busy_s
        dist.all_reduce(values, group=self.control_group)
        shares = values[1:].tolist()
        return float(values[0]), [int(v) for v in shares[: self.world]], [float(v) for v in shares[self.world :]]

    def reduce_sums(self, *values: float) -> list[float]:
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, group=self.control_group)
        return tensor.tolist()

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.control_group)

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def inject_fault(self, step: int) -> None:
        """The crash hook of the rank-failure test (see :data:`FAULT_ENV`); nothing unless that variable is set."""
        spec = os.environ.get(FAULT_ENV)
        if spec and self.distributed and spec == f"{self.rank}:{step}":
            os._exit(3)

    # --- the model on the ranks -----------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module | None:
        """The loss module the training loop calls: DDP around it, or FSDP2 with it as the root; None alone."""
        if self.mode == "single":
            return None
        module = LossModule(model)
        if self.mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=_mesh(device, self.world))
            return module
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
            find_unused_parameters=_has_experts(model),
            init_sync=False,  # every rank builds the same seeded adapter; broadcasting frozen (4-bit) weights is waste
        )
        self.clock.arm(self.rank)
        wrapped.register_comm_hook(None, self.clock.hook)  # DDP's all-reduce, noting when the gradients were ready
        return wrapped

    def shard_layers(self, model: torch.nn.Module, device: torch.device) -> None:
        """FSDP2: shard each decoder layer over the ranks (the root is sharded by :meth:`wrap`)."""
        if self.mode != "fsdp":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh(device, self.world)
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh)

    def full_trainable_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """FSDP2: the trainable weights gathered whole on the CPU (a collective); None when nothing is sharded."""
        if self.mode != "fsdp":
            return None
        return {name: _full(p).cpu() for name, p in model.named_parameters() if p.requires_grad}

    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """What the checkpoint saves for the optimizer: itself, or under FSDP2 its state gathered whole."""
        if self.mode != "fsdp":
            return optimizer
        state = optimizer.state_dict()
        state["state"] = {
            key: {name: (_full(v).cpu() if torch.is_tensor(v) else v) for name, v in values.items()}
            for key, values in state["state"].items()
        }
        return _SavedState(state)

    def shard_like(self, current: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Whole checkpoint tensors laid out like the model's (sharded) ones, ready for ``load_state_dict``."""
        if self.mode != "fsdp":
            return weights
        return {key: _shard_as(value, current[key]) if key in current else value for key, value in weights.items()}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """FSDP2: after loading a whole optimizer state, shard each moment like its parameter."""
        if self.mode != "fsdp":
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for name, value in list(state.items()):
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
                        state[name] = _shard_as(value, param)


class _SavedState:
    """A gathered optimizer state posing as the optimizer for :func:`engine.run.checkpoint.save_checkpoint`."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def _full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def plain_number(value: torch.Tensor) -> float:
    """A (possibly sharded) scalar as a float: a gradient norm under FSDP2 is a DTensor."""
    return float(_full(value))


def _shard_as(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return value
    whole = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def _mesh(device: torch.device, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks transformers itself never splits (``_no_split_modules``): the decoder layers."""
    from engine.speed import transformers_model

    names = set(getattr(transformers_model(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"FSDP2 cannot find the decoder layers of {type(transformers_model(model)).__name__}",
            hint="train it with --parallel ddp",
        )
    return layers


def _has_experts(model: torch.nn.Module) -> bool:
    """MoE models leave unrouted experts without a gradient in some micro-batches: DDP must look for them."""
    from engine.speed import moe_routing, transformers_model

    return bool(moe_routing.has_routable_experts(transformers_model(model)))
