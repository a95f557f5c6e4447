"""A module that stands in for another inside the model tree without changing any name in it.

Speed switches that wrap a module (:class:`engine.speed.chunked_mlp.TokenChunked`,
:class:`engine.speed.lean_recompute.FrozenProjection`) share the wrapped module's child, parameter and buffer
dictionaries, so parameter names, state dicts and saved adapters are the same while they are in place, and switching
off puts the original object back. The wrapped module itself is kept unregistered.

Names are unchanged, types are not: code that finds modules by their class (peft's adapter state dict keeps only
the entries of its own LoRA layers; its ``disable_adapter`` switches only those off) does not see a LoRA layer
behind a stand-in. Such code runs inside :func:`own_tree`, and the engine's own searches use :func:`own_modules`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Self

import torch

__all__ = ["StandIn", "adapters_off", "hides_an_adapter", "own_modules", "own_tree", "seen_through"]


class StandIn(torch.nn.Module):
    """Shares ``wrapped``'s children, parameters and buffers; keeps its training flag in step."""

    wrapped: torch.nn.Module

    def __init__(self, wrapped: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "wrapped", wrapped)
        self._modules = wrapped._modules
        self._parameters = wrapped._parameters
        self._buffers = wrapped._buffers
        self.training = wrapped.training

    def train(self, mode: bool = True) -> Self:
        self.wrapped.training = mode
        return super().train(mode)


def seen_through(module: torch.nn.Module) -> torch.nn.Module:
    """The model's own module behind ``module``'s stand-ins (``module`` itself where it is one)."""
    while isinstance(module, StandIn):
        module = module.wrapped
    return module


def own_modules(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model.modules()`` with every stand-in replaced by the module it stands for."""
    for module in model.modules():
        yield seen_through(module)


def hides_an_adapter(module: torch.nn.Module) -> bool:
    """``module`` is a stand-in for one of peft's adapter layers (a LoRA projection in sequence chunks)."""
    if not isinstance(module, StandIn):
        return False
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(seen_through(module), BaseTunerLayer)


@contextlib.contextmanager
def own_tree(model: torch.nn.Module) -> Iterator[None]:
    """peft's adapter layers in place of the stand-ins that hide them while the body runs, the stand-ins back after
    it: for peft's code that finds its layers by class. Stand-ins that hide no adapter layer (a chunked MLP or norm,
    a frozen base projection) stay, so nothing else in the tree changes. Between steps only."""
    swapped = [
        (module._modules, name, child)
        for module in model.modules()
        for name, child in module._modules.items()
        if child is not None and hides_an_adapter(child)
    ]
    for modules, name, child in swapped:
        modules[name] = seen_through(child)
    try:
        yield
    finally:
        for modules, name, child in reversed(swapped):
            modules[name] = child


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """peft's ``disable_adapter()`` on a model with stand-ins in it: every LoRA layer is switched off (found in
    :func:`own_tree`) while the stand-ins keep working for the body's forward passes."""
    switch = model.disable_adapter()
    with own_tree(model):
        switch.__enter__()
    try:
        yield
    finally:
        with own_tree(model):
            switch.__exit__(None, None, None)
