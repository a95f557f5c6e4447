"""Activation checkpointing whose saved layer inputs live in host memory, with look-ahead prefetch.

Checkpointing keeps only each decoder layer's input and recomputes the layer in backward. Those inputs still
add up (layers × tokens × hidden: 3.7 GB for Qwen3-0.6B at 64k tokens), so here each one is copied to pinned
host memory on a side stream during forward, behind a ring of two in-flight copies that bounds how long a layer
input is kept alive on the device. In backward, while layer i recomputes, layer i-1's input is already on its
way back on a second stream: a real look-ahead prefetch, so the copies hide behind compute instead of
overlapping by accident (torch's ``save_on_cpu`` and transformers' ``offload=True`` copy on the compute stream;
torchtune and Unsloth reload only when backward reaches the layer). Reported cost elsewhere: ~0.7% step time.

Pinned memory has a budget and a pageable fallback (WSL caps pinned memory, and the failure looks like CUDA
out of memory). Offloading is skipped for integrated-memory GPUs (DGX Spark: host and device memory are the
same, one library measured 3.62 -> 1.68 s/step after turning it off) and for layer inputs too small to matter,
where plain recompute runs instead. Modes: none, standard (recompute), offloaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from engine.hardware.detect import running_under_wsl

MODES = ("none", "standard", "offloaded")
MIN_OFFLOAD_BYTES = 8 << 20
"""Below 8 MiB per layer input (e.g. 4k tokens × 1k hidden in bf16) offloading saves too little to pay for itself."""


@dataclass
class RecomputeFlag:
    """Whether backward is recomputing an offloaded layer right now: its outputs are thrown away, only what the
    layer's operations save for their gradients is used (the chunked MLP and lean recompute skip work then).

    Also set while a recompute unit (a checkpointed MLP) recomputes for its own backward, which reads no output
    value either. A plain attribute: compiled regions guard on it (one graph per value), where reading a ContextVar
    would break their graphs. Each :class:`ActivationOffloader` owns one and hands it to the modules that read it."""

    active: bool = False

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        """Set for the block, then back to what it was (recompute units run inside layer recomputes too)."""
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous


def with_index(device: torch.device) -> torch.device:
    """``device`` naming its GPU by index: tensors say ``cuda:0`` where a setting said ``cuda``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (engine.speed.step_graphs)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def standard_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """transformers' standard recompute: non-reentrant, so LoRA needs no input-gradient hook. Inside a CUDA graph
    capture the RNG state is not saved (step graphs run only models without dropout)."""
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=not capturing(), **kwargs)


def default_pinned_budget() -> int:
    """Half the machine's memory, or an eighth under WSL, whose driver caps pinned allocations."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return total // 8 if running_under_wsl() else total // 2


def offload_unsupported_reason(device: torch.device) -> str | None:
    """Why offloading to host memory would not help on this device (None when it would)."""
    if device.type == "cuda" and getattr(torch.cuda.get_device_properties(device), "is_integrated", False):
        return "integrated-memory GPU: host and device memory are the same, offloading only adds copies"
    return None


@dataclass(eq=False)
class _Slot:
    """One layer input parked in host memory during one step."""

    index: int
    host: torch.Tensor
    shape: torch.Size
    d2h_done: torch.cuda.Event | None = None
    h2d_done: torch.cuda.Event | None = None
    device_copy: torch.Tensor | None = None


@dataclass(eq=False)
class _HostBuffer:
    tensor: torch.Tensor
    pinned: bool
    last_read: torch.cuda.Event | None = None


@dataclass
class ActivationOffloader:
    """Moves checkpointed layer inputs to host memory and back, overlapping the copies with compute."""

    device: torch.device
    pinned_budget: int = field(default_factory=default_pinned_budget)
    min_offload_bytes: int = MIN_OFFLOAD_BYTES
    pinned_bytes: int = 0
    pinned_failed: bool = False
    _buffers: list[_HostBuffer] = field(default_factory=list)
    _pending: list[_Slot] = field(default_factory=list)
    _ring: list[tuple[torch.Tensor, torch.cuda.Event] | None] = field(default_factory=lambda: [None, None])
    _streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
    _anchor: torch.Tensor | None = None
    recompute: RecomputeFlag = field(default_factory=RecomputeFlag)

    def __post_init__(self) -> None:
        self.device = with_index(self.device)  # compared with the devices tensors name

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(device->host, host->device) side streams, created on first use."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def begin_batch(self) -> None:
        """Forget slots of a step whose backward never ran (an aborted step); their buffers are reused."""
        self._release_ring()
        self._pending.clear()

    def forget_events(self) -> None:
        """Drop the copy events of earlier steps (around a CUDA graph capture: a capture may not wait on an event
        recorded outside it, and eager steps must not wait on one recorded inside it). Stream order already covers
        them: every copy waits for the compute stream first."""
        for buf in self._buffers:
            buf.last_read = None
        self._ring = [None, None]

    def anchor(self) -> torch.Tensor:
        """An empty tensor that requires grad, so backward reaches every layer even when its input needs none."""
        if self._anchor is None:
            self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        return self._anchor

    def _host_buffer(self, index: int, like: torch.Tensor) -> _HostBuffer:
        while len(self._buffers) <= index:
            self._buffers.append(_HostBuffer(torch.empty(0), pinned=False))
        buf = self._buffers[index]
        if buf.tensor.numel() >= like.numel() and buf.tensor.dtype == like.dtype:
            return buf
        if buf.pinned:
            self.pinned_bytes -= buf.tensor.numel() * buf.tensor.element_size()
        buf.tensor, buf.pinned = self._allocate_host(like.numel(), like.dtype), False
        if buf.tensor.is_pinned():
            buf.pinned = True
            self.pinned_bytes += like.numel() * like.element_size()
        return buf

    def _allocate_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self.is_cuda and not self.pinned_failed and self.pinned_bytes + nbytes <= self.pinned_budget:
            try:
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            except RuntimeError:  # WSL and some drivers refuse pinned memory as "CUDA out of memory"
                self.pinned_failed = True
        return torch.empty(numel, dtype=dtype)

    def stash(self, hidden: torch.Tensor) -> _Slot:
        """Start copying a layer input to host memory; returns the slot to fetch it back from."""
        index = len(self._pending)
        buf = self._host_buffer(index, hidden)
        host = buf.tensor[: hidden.numel()]
        slot = _Slot(index, host, hidden.shape)
        self._pending.append(slot)
        if not self.is_cuda:
            host.copy_(hidden.reshape(-1))
            return slot
        d2h, _ = self.streams()
        compute = torch.cuda.current_stream(self.device)
        d2h.wait_stream(compute)  # the layer input is ready
        if buf.last_read is not None:
            d2h.wait_event(buf.last_read)  # the previous step's prefetch has read this buffer
        with torch.cuda.stream(d2h):
            host.copy_(hidden.reshape(-1), non_blocking=True)
            slot.d2h_done = torch.cuda.Event()
            slot.d2h_done.record(d2h)
        # Ring of two: keep the input alive until its copy is done; reusing a ring entry waits for the copy
        # issued two layers ago, which has long finished unless copies fall behind compute.
        old = self._ring[index % 2]
        if old is not None:
            compute.wait_event(old[1])
        self._ring[index % 2] = (hidden, slot.d2h_done)
        return slot

    def _release_ring(self) -> None:
        if not self.is_cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for i, entry in enumerate(self._ring):
            if entry is not None:
                compute.wait_event(entry[1])
                self._ring[i] = None

    def _prefetch(self, slot: _Slot) -> None:
        """Start copying a slot back to the device on the host->device stream."""
        if slot.device_copy is not None:
            return
        _, h2d = self.streams()
        compute = torch.cuda.current_stream(self.device)
        target = torch.empty(slot.shape, dtype=slot.host.dtype, device=self.device)
        h2d.wait_stream(compute)  # the target's memory is free in compute-stream order
        if slot.d2h_done is not None:
            h2d.wait_event(slot.d2h_done)
        with torch.cuda.stream(h2d):
            target.reshape(-1).copy_(slot.host, non_blocking=True)
            slot.h2d_done = torch.cuda.Event()
            slot.h2d_done.record(h2d)
        self._buffers[slot.index].last_read = slot.h2d_done
        slot.device_copy = target

    def fetch(self, slot: _Slot) -> torch.Tensor:
        """The layer input back on the device; starts prefetching the input of the layer below."""
        position = next(i for i, s in enumerate(self._pending) if s is slot)
        below = self._pending[position - 1] if position > 0 else None
        del self._pending[position]
        if not self.is_cuda:
            return slot.host.clone().view(slot.shape)
        self._release_ring()
        self._prefetch(slot)
        assert slot.h2d_done is not None
        torch.cuda.current_stream(self.device).wait_event(slot.h2d_done)
        hidden, slot.device_copy = slot.device_copy, None
        if below is not None:
            self._prefetch(below)  # look-ahead: overlaps with this layer's recompute
        assert hidden is not None
        return hidden

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A gradient-checkpointing function for transformers: ``fn(partial(layer, **kwargs), hidden_states)``."""
        hidden = args[0] if len(args) == 1 and not kwargs else None
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.numel() * hidden.element_size() < self.min_offload_bytes:
            return standard_checkpoint(function, *args, **kwargs)
        # torch leaves Function.apply unannotated
        return _OffloadedLayer.apply(function, self, hidden, self.anchor())  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class ReplayState:
    """RNG and autocast state at forward time, so that recompute draws the same dropout masks."""

    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    device: torch.device
    autocast: bool
    autocast_dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> ReplayState:
        """The state now; the GPU's RNG state is left out inside a CUDA graph capture, which cannot read it (step
        graphs run only models without dropout)."""
        device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" and not capturing() else None
        return cls(
            cpu_rng=torch.get_rng_state(),
            device_rng=device_rng,
            device=device,
            autocast=torch.is_autocast_enabled(device.type),
            autocast_dtype=torch.get_autocast_dtype(device.type),
        )

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        devices = [self.device] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.device)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast):
                yield


class _OffloadedLayer(torch.autograd.Function):
    """Runs a layer without saving activations; backward fetches its input back and recomputes it."""

    @staticmethod
    def forward(
        ctx: Any, run: Callable[[torch.Tensor], Any], offloader: ActivationOffloader, hidden: torch.Tensor, _: Any
    ) -> Any:
        ctx.run, ctx.offloader = run, offloader
        ctx.replay = ReplayState.capture(hidden.device)
        ctx.slot = offloader.stash(hidden)  # before the layer runs, so the copy overlaps with its compute
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        hidden = ctx.offloader.fetch(ctx.slot).detach().requires_grad_(ctx.needs_input_grad[2])
        with ctx.offloader.recompute.raised(), torch.enable_grad(), ctx.replay.restored():
            out = ctx.run(hidden)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=False) if isinstance(o, torch.Tensor) and o.requires_grad]
        pairs = [(o, g) for o, g in pairs if g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, hidden.grad if ctx.needs_input_grad[2] else None, None
