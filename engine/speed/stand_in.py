"""A module that stands in for another inside the model tree without changing any name in it.

Speed switches that wrap a module (:class:`engine.speed.chunked_mlp.TokenChunked`,
:class:`engine.speed.lean_recompute.FrozenProjection`) share the wrapped module's child, parameter and buffer
dictionaries, so parameter names, state dicts and saved adapters are the same while they are in place, and switching
off puts the original object back. The wrapped module itself is kept unregistered.
"""

from __future__ import annotations

from typing import Self

import torch


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
