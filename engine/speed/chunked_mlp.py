"""Per-token modules run over slices of the sequence, so their activations never exist for the whole row.

Why: with checkpointing, a decoder layer's activations exist only while that one layer recomputes in backward,
but for one layer of a long row they are still large. For Llama-3.1-8B with LoRA the MLP keeps its gate, up and
activation outputs (3 x 14,336 x 2 bytes per token) and their gradients in backward, 18 GB at 95k tokens before
anything else; the norms of eager layers keep float32 copies of their inputs too. These modules treat every token
alone, so they run over chunks of the sequence as one autograd function each (:class:`_ChunkedRun`): forward fills
one output chunk by chunk without gradients and keeps only the module's input (a tensor that is kept anyway);
backward recomputes one chunk at a time, so only one chunk's intermediates ever exist, and sums the chunks'
parameter gradients before handing them on (one gradient per parameter, as DDP's hooks expect).

Inside an offloaded layer's recompute the MLP's output feeds only the residual sum, whose result the recompute
throws away, so the MLP is not run there at all (layers that normalise the MLP's output, Gemma-style, still run
it): chunking then costs no extra MLP forward, only smaller matmuls and more calls. With compiled layers (the
fused-kernels switch) only the MLPs are chunked; each chunked module is a compiled call per chunk.

Chunk size (:func:`choose_chunk_tokens`) follows the MLP's width, so one chunk's working set stays near
256 MB. Exact: each token sees the same operations as unchunked (with LoRA dropout the masks are drawn per chunk, so
equal in distribution rather than bit for bit). Cost (H200, 16k tokens, offloaded checkpointing, compiled layers):
1.30x the step time of Llama-3.2-1B and Qwen3-0.6B for 5.23 -> 3.61 and 2.65 -> 2.25 GiB; for 4-bit layers one
weight dequantization per chunk. Hence the switch is automatic only for long rows under checkpointing
(:data:`AUTO_MIN_TOKENS`) when memory is short.

The wrapped modules stay where they were in the module tree: :class:`TokenChunked` shares their children,
parameters and buffers, so parameter names, state dicts and saved adapters do not change while it is on, and
switching it off puts the original module object back. (While it is on, a scan of the tree for peft's LoRA
layer class finds their children but not the q/k/v/o layers themselves; the training step never scans.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from engine.hardware import planner
from engine.speed.offloaded_checkpoint import RecomputeFlag, ReplayState
from engine.speed.stand_in import StandIn

__all__ = [
    "AUTO_MIN_TOKENS",
    "CHUNK_TOKENS",
    "ChunkedModules",
    "TokenChunked",
    "choose_chunk_tokens",
    "chunked_call",
    "per_token_targets",
    "resolve",
]

CHUNK_TOKENS = 4096
"""Chunk size for a model whose configuration does not give the MLP's width."""
AUTO_MIN_TOKENS = planner.CHUNK_MIN_ROW_TOKENS
AUTO_FREE_SHARE = planner.CHUNK_FREE_SHARE
"""Automatic mode chunks only when one layer's unchunked per-token working set exceeds this share of free memory
(the planner plans rows by the same rule)."""
LAYER_TARGETS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp",
)
"""Per-token submodules of a decoder layer, by attribute path (the attention core mixes tokens: never chunked)."""


def choose_chunk_tokens(config: Any) -> int:
    """Tokens per chunk for a model's configuration (:func:`engine.hardware.planner.chunk_tokens_for`, which the
    memory planner uses too)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    intermediate = getattr(config, "intermediate_size", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return planner.chunk_tokens_for(intermediate, hidden) or CHUNK_TOKENS


def chunked_call(module: torch.nn.Module, hidden: torch.Tensor, chunk_tokens: int, *args: Any, **kwargs: Any) -> Any:
    """``module(hidden, *args, **kwargs)`` computed over slices of ``hidden``'s sequence dimension (dim -2)."""
    length = hidden.shape[-2] if hidden.dim() >= 2 else 0
    if length <= chunk_tokens:
        return module(hidden, *args, **kwargs)
    pieces = hidden.split(chunk_tokens, dim=-2)
    if not torch.is_grad_enabled():
        return _into_one_output(module, pieces, length, *args, **kwargs)
    outputs = [checkpoint(module, piece, *args, use_reentrant=False, **kwargs) for piece in pieces]
    return torch.cat(outputs, dim=-2)


def _into_one_output(
    module: torch.nn.Module, pieces: tuple[torch.Tensor, ...], length: int, *args: Any, **kwargs: Any
) -> torch.Tensor:
    first: torch.Tensor = module(pieces[0], *args, **kwargs)
    out = first.new_empty((*first.shape[:-2], length, first.shape[-1]))
    out[..., : first.shape[-2], :] = first
    start = first.shape[-2]
    del first
    for piece in pieces[1:]:
        out[..., start : start + piece.shape[-2], :] = module(piece, *args, **kwargs)
        start += piece.shape[-2]
    return out


class _ChunkedRun(torch.autograd.Function):
    """A per-token module over chunks that keeps only its input: forward fills one output chunk by chunk without
    gradients; backward recomputes one chunk at a time and sums the chunks' parameter gradients, so each
    parameter receives one gradient per call (as data-parallel gradient hooks expect).

    ``discard`` skips the forward entirely and returns uninitialised memory: only for an MLP recomputed inside an
    offloaded layer, whose output feeds nothing but the residual sum that the recompute throws away. ``flag`` is
    raised while backward recomputes a chunk: nothing reads the chunk's output value there either, so frozen
    projections may skip it (:mod:`engine.speed.lean_recompute`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        module: torch.nn.Module,
        chunk_tokens: int,
        discard: bool,
        flag: RecomputeFlag,
        hidden: torch.Tensor,
        *params: Any,
    ) -> torch.Tensor:
        ctx.module, ctx.chunk_tokens, ctx.params, ctx.flag = module, chunk_tokens, params, flag
        ctx.replay = ReplayState.capture(hidden.device)
        ctx.save_for_backward(hidden)
        if discard:
            return torch.empty_like(hidden)
        with torch.no_grad():
            return _into_one_output(module, hidden.split(chunk_tokens, dim=-2), hidden.shape[-2])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (hidden,) = ctx.saved_tensors
        params = list(ctx.params)
        want_input = bool(ctx.needs_input_grad[4])
        grad_in = torch.empty_like(hidden) if want_input else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        with torch.enable_grad(), ctx.replay.restored(), ctx.flag.raised():
            for piece, grad_piece in zip(
                hidden.split(ctx.chunk_tokens, dim=-2), grad_out.split(ctx.chunk_tokens, dim=-2), strict=True
            ):
                x = piece.detach().requires_grad_(want_input)
                inputs = [x, *params] if want_input else params
                got = torch.autograd.grad(ctx.module(x), inputs, grad_piece, allow_unused=True)
                if grad_in is not None:
                    grad_in[..., start : start + piece.shape[-2], :] = got[0]
                    got = got[1:]
                sums = [g if s is None else (s if g is None else s + g) for s, g in zip(sums, got, strict=True)]
                start += piece.shape[-2]
        return (None, None, None, None, grad_in, *sums)


class TokenChunked(StandIn):
    """Stands in for a per-token module and runs it over chunks of the sequence (names unchanged: :class:`StandIn`).

    ``flag`` is the offloader's: while it is set, an offloaded layer is recomputing.
    """

    def __init__(
        self,
        wrapped: torch.nn.Module,
        chunk_tokens: int,
        feeds_residual_only: bool = False,
        flag: RecomputeFlag | None = None,
    ) -> None:
        super().__init__(wrapped)
        self.chunk_tokens = chunk_tokens
        self.feeds_residual_only = feeds_residual_only
        """The output goes straight into the layer's residual sum (a Llama-style MLP): an offloaded layer's
        recompute may skip computing it."""
        self.flag = flag or RecomputeFlag()

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        length = hidden.shape[-2] if hidden.dim() >= 2 else 0
        one_chunk = length <= self.chunk_tokens
        if args or kwargs or not torch.is_grad_enabled() or length == 0 or one_chunk:
            return chunked_call(self.wrapped, hidden, self.chunk_tokens, *args, **kwargs)
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        discard = self.feeds_residual_only and self.flag.active
        # torch leaves Function.apply unannotated
        return _ChunkedRun.apply(self.wrapped, self.chunk_tokens, discard, self.flag, hidden, *params)  # type: ignore[no-untyped-call]

    def extra_repr(self) -> str:
        return f"{type(self.wrapped).__name__} in chunks of {self.chunk_tokens} tokens"


def feeds_residual_only(layer: torch.nn.Module) -> bool:
    """The decoder layer adds its MLP's output straight to the residual stream (no norm of that output after it,
    as Gemma-style layers have), so a recompute that throws the layer's output away never reads it."""
    return not hasattr(layer, "post_feedforward_layernorm")


def _is_dense_mlp(module: torch.nn.Module) -> bool:
    """MoE blocks route tokens and may add an auxiliary loss over the whole batch: only plain MLPs qualify."""
    names = set(dict(module.named_children()))
    return {"gate_proj", "up_proj", "down_proj"} <= names or {"fc1", "fc2"} <= names


def per_token_targets(
    hf_model: torch.nn.Module, mlp_only: bool = False
) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) for every per-token module of the decoder layers, and the final norm (only
    the MLPs with ``mlp_only``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in hf_model.modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        for path in ("mlp",) if mlp_only else LAYER_TARGETS:
            *parents, name = path.split(".")
            parent = layer.get_submodule(".".join(parents)) if parents else layer
            module = getattr(parent, name, None)
            if isinstance(module, torch.nn.Module) and (name != "mlp" or _is_dense_mlp(module)):
                yield parent, name, module
    if mlp_only:
        return
    get_decoder = getattr(hf_model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    norm = getattr(decoder, "norm", None)
    if decoder is not None and isinstance(norm, torch.nn.Module):
        yield decoder, "norm", norm


@dataclass
class ChunkedModules:
    """Installs and removes the chunked stand-ins for one model; flipping it between steps is safe."""

    hf_model: torch.nn.Module
    installed: list[tuple[torch.nn.Module, str, TokenChunked]] = field(default_factory=list)
    mlp_only: bool = False
    chunk_tokens: int | None = None
    """A chunk size asked for explicitly; later installs keep it (otherwise :func:`choose_chunk_tokens`)."""
    flag: RecomputeFlag = field(default_factory=RecomputeFlag)
    """The offloader's recompute flag (the speed controller passes it), read by every stand-in."""

    @property
    def on(self) -> bool:
        return bool(self.installed)

    def install(self, chunk_tokens: int | None = None, mlp_only: bool = False) -> int:
        """Wrap every per-token module, or only the MLPs (or update the chunk size); returns how many are chunked.

        ``chunk_tokens`` defaults to :func:`choose_chunk_tokens` for the model. ``mlp_only`` suits compiled
        layers (the fused-kernels switch): their norms keep 16-bit inputs and the projections' inputs are
        shared with the attention, so the MLP's intermediates are what is worth chunking, and every chunked
        module costs a compiled call per chunk (all seven chunked: 2.1 s instead of 0.29 s per Llama-3.2-1B
        step on the H200, the GPU idle between calls).
        """
        if chunk_tokens:
            self.chunk_tokens = chunk_tokens
        chunk_tokens = self.chunk_tokens or choose_chunk_tokens(getattr(self.hf_model, "config", None))
        if self.installed and mlp_only != self.mlp_only:
            self.remove()
        if self.installed:
            for _, _, wrapper in self.installed:
                wrapper.chunk_tokens = chunk_tokens
            return len(self.installed)
        self.mlp_only = mlp_only
        self._wrap(chunk_tokens, mlp_only)
        return len(self.installed)

    def _wrap(self, chunk_tokens: int, mlp_only: bool) -> None:
        for parent, name, module in list(per_token_targets(self.hf_model, mlp_only)):
            if isinstance(module, TokenChunked):  # left behind by an earlier controller
                module = module.wrapped
            residual_only = name == "mlp" and feeds_residual_only(parent)
            wrapper = TokenChunked(module, chunk_tokens, feeds_residual_only=residual_only, flag=self.flag)
            parent._modules[name] = wrapper
            self.installed.append((parent, name, wrapper))

    def remove(self) -> None:
        """Put the original modules back."""
        for parent, name, wrapper in self.installed:
            parent._modules[name] = wrapper.wrapped
        self.installed.clear()


def row_working_bytes(config: Any, tokens: int) -> int:
    """What one layer's per-token modules would hold for a whole row of ``tokens`` without chunking."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    intermediate = getattr(config, "intermediate_size", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return tokens * (10 * intermediate + 8 * hidden)


def resolve(
    requested: bool | None,
    checkpointing: str,
    tokens: int,
    min_tokens: int = AUTO_MIN_TOKENS,
    *,
    working_bytes: int | None = None,
    free_bytes: int | None = None,
) -> tuple[bool, str]:
    """(on, reason) for the switch: automatic is on for rows longer than ``min_tokens`` under checkpointing and,
    when the GPU's free memory is known, only where one layer's unchunked working set would take more than
    :data:`AUTO_FREE_SHARE` of it (measured on the H200 at 16,384 tokens under offloaded checkpointing, chunking
    the MLPs of compiled layers cost 1.30x the step time of Llama-3.2-1B and Qwen3-0.6B for 5.23 -> 3.61 and
    2.65 -> 2.25 GiB: worth it only where memory decides whether the row trains at all)."""
    if requested is False:
        return False, "switched off: each per-token module runs over the whole row"
    if requested:
        return True, "switched on; per-token modules run over chunks of the sequence"
    if checkpointing == "none":
        return False, "automatic: off without checkpointing (every activation is kept anyway)"
    if tokens <= min_tokens:
        return False, f"automatic: off for rows of up to {min_tokens:,} tokens"
    if working_bytes is not None and free_bytes is not None and working_bytes <= AUTO_FREE_SHARE * free_bytes:
        return False, (
            f"automatic: off; one layer's per-token work on {tokens:,} tokens (~{working_bytes / 2**30:.1f} GiB) fits "
            f"in free GPU memory ({free_bytes / 2**30:.1f} GiB), and chunks would cost recompute time"
        )
    return True, f"automatic: rows of {tokens:,} tokens under checkpointing run per-token modules in chunks"
