"""The frozen input embedding looked up in host memory, so its table takes no GPU memory.

Why: for Llama-3.1-8B the input embedding is a 128,256 x 4,096 table, 1 GiB in 16-bit: under QLoRA that is a
fifth of the model on the GPU, and on an 8 GiB card it is the memory of about 9,000 more tokens of a row
(measured: ~107 KB per token with every other memory switch on). Training only ever reads the rows of the
tokens in the batch, and a frozen table never needs a gradient. So the table moves to host memory and the
lookup runs there: a forward pre-hook on the embedding module hands it the ids on the host, a forward hook
sends the looked-up rows (tokens x hidden, 8 KB a token for 8B) back to the GPU. Cost: a host gather and one
copy per micro-batch, about 10 ms for 14k tokens, small beside a long row's step of seconds. The ids come from the
batch's host copy (:attr:`engine.data.packing.PackedBatch.host_input_ids`, staged by the speed controller) and the rows
go up from pinned memory without blocking, so the lookup adds no host sync. Automatic: on where the table is a
large share of the GPU's memory (:data:`AUTO_TABLE_SHARE`; 12% for Llama-3.1-8B on an 8 GiB card), off elsewhere.

Not for a trained embedding (its gradient would land in host memory) or one tied to the output head, which
needs the same table on the GPU. Switching off moves the table back and removes the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from engine.hardware.planner import AUTO_TABLE_SHARE, table_crowds_card

__all__ = ["AUTO_TABLE_SHARE", "HostEmbedding", "resolve", "unsupported_reason"]


def unsupported_reason(hf_model: Any) -> str | None:
    """Why this model's input embedding cannot live in host memory, or None when it can."""
    embed = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
    if not isinstance(embed, torch.nn.Embedding):
        return "the input embedding is not a plain embedding table"
    if embed.weight.requires_grad:
        return "the input embedding is trained"
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is embed.weight:
        return "the input embedding is tied to the output head, which needs it on the GPU"
    return None


def resolve(
    requested: bool | None, on_gpu: bool, problem: str | None, table_bytes: int, usable_bytes: int | None
) -> tuple[bool, str]:
    """(on, reason): on when asked for, or automatically where the table (``table_bytes``) would take more than
    :data:`AUTO_TABLE_SHARE` of ``usable_bytes`` (the GPU memory this process may use); on a GPU, for a model
    that allows it (``problem``: :func:`unsupported_reason`)."""
    if requested is False:
        return False, f"switched off: the input embedding stays {'on the GPU' if on_gpu else 'with the model'}"
    if not on_gpu:
        return False, "the model already lives in host memory"
    if problem is not None:
        return False, problem
    if requested:
        return True, "switched on; the input embedding table is looked up in host memory"
    if usable_bytes is None or not table_crowds_card(table_bytes, usable_bytes):
        return False, "automatic: off, the input embedding table is a small share of GPU memory"
    size = f"{table_bytes / 2**30:.1f} GiB, {table_bytes / usable_bytes:.0%} of GPU memory"
    return True, f"automatic: the input embedding table ({size}) is looked up in host memory"


@dataclass(eq=False)
class _PinnedSlot:
    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    done: Any = None
    """The CUDA event recorded after the buffer's last upload."""


@dataclass
class HostEmbedding:
    """Moves one model's input embedding between host and GPU memory; safe between two steps."""

    hf_model: Any
    device: torch.device
    _hooks: list[Any] = field(default_factory=list)
    _staged: torch.Tensor | None = None
    _pinned: list[_PinnedSlot] = field(default_factory=lambda: [_PinnedSlot(), _PinnedSlot()])
    _turn: int = 0

    @property
    def on(self) -> bool:
        return bool(self._hooks)

    def resolve(self, requested: bool | None, usable_bytes: int | None = None) -> tuple[bool, str]:
        """(on, reason) for this model on its device (:func:`resolve`)."""
        on_gpu = self.device.type == "cuda"
        problem = unsupported_reason(self.hf_model) if on_gpu else None
        table = self.table_bytes() if on_gpu and problem is None else 0
        return resolve(requested, on_gpu, problem, table, usable_bytes)

    def table_bytes(self) -> int:
        weight: torch.Tensor = self.hf_model.get_input_embeddings().weight
        return weight.numel() * weight.element_size()

    def stage(self, host_ids: torch.Tensor | None) -> None:
        """The next forward's token ids, already on the host (None: they are copied back from the GPU)."""
        self._staged = host_ids

    def _ids_to_host(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids, staged = args[0], self._staged
        self._staged = None
        if staged is not None and staged.shape == ids.shape:
            return (staged, *args[1:])
        return (ids.to("cpu"), *args[1:])

    def switch(self, on: bool) -> None:
        if on:
            self.install()
        else:
            self.remove()

    def install(self) -> None:
        if self._hooks:
            return
        embed = self.hf_model.get_input_embeddings()
        embed.to("cpu")
        device = self.device

        def rows_to_device(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            return self._upload(output) if device.type == "cuda" else output.to(device)

        hooks = [embed.register_forward_pre_hook(self._ids_to_host), embed.register_forward_hook(rows_to_device)]
        self._hooks = hooks

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` on the GPU, gathered on the host straight into a pinned buffer (one pass
        over 8 KB a token for 8B, not a gather and then a copy), the way the hooks would give them. An embedding
        that is not a plain table (a subclass that scales its rows, a norm cap) goes through its module."""
        embed = self.hf_model.get_input_embeddings()
        if not self.on or type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
            return cast(torch.Tensor, embed(ids))
        (host_ids,) = self._ids_to_host(embed, (ids,))
        weight = embed.weight
        slot, staging = self._staging(host_ids.numel() * weight.shape[1], weight.dtype)
        torch.index_select(weight, 0, host_ids.reshape(-1), out=staging.view(host_ids.numel(), weight.shape[1]))
        return self._send(slot, staging.view(*host_ids.shape, weight.shape[1]))

    def _upload(self, rows: torch.Tensor) -> torch.Tensor:
        """Send the looked-up rows to the GPU from one of two pinned buffers, without blocking the host."""
        slot, staging = self._staging(rows.numel(), rows.dtype)
        staging = staging.view(rows.shape)
        staging.copy_(rows)
        return self._send(slot, staging)

    def _staging(self, numel: int, dtype: torch.dtype) -> tuple[_PinnedSlot, torch.Tensor]:
        """The next of two pinned buffers, ``numel`` long, with its slot. A buffer is reused once its last copy is
        done (an event query, not a wait), so pinned memory is allocated (``cudaHostAlloc``, which synchronizes)
        only in the first steps and when rows grow."""
        slot = self._pinned[self._turn]
        self._turn ^= 1
        busy = slot.done is not None and not slot.done.query()
        if busy or slot.buffer.numel() < numel or slot.buffer.dtype != dtype:
            slot.buffer = torch.empty(numel, dtype=dtype, pin_memory=self.device.type == "cuda")
        return slot, slot.buffer[:numel]

    def _send(self, slot: _PinnedSlot, staging: torch.Tensor) -> torch.Tensor:
        """The staged rows on the device; the slot remembers when its copy is done."""
        if self.device.type != "cuda":
            return staging.to(self.device, copy=True)  # the buffer is reused: the rows must not alias it
        out = staging.to(self.device, non_blocking=True)
        slot.done = torch.cuda.Event()
        slot.done.record()
        return out

    def remove(self) -> None:
        if not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.hf_model.get_input_embeddings().to(self.device)
