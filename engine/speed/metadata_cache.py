"""Packed-sequence metadata built once per batch and handed to every attention call.

A packed row holds many documents, and no token may attend across a document boundary. transformers' own packed
path rediscovers the boundaries from ``position_ids`` (a device->host sync) and builds a dense T×T mask that
SDPA then evaluates in full, and its flash path recomputes ``cu_seqlens`` in every layer. The collator already
knows the boundaries on the host (``PackedBatch.cu_seqlens``, ``max_seqlen``), so this module uploads them once
per batch (pinned, non-blocking) and registers an attention function that consumes them in every layer, in the
forward pass and in checkpoint recomputation alike (the metadata travels as a model keyword argument, which
transformers binds into each layer call). Measured on the H200 (Qwen3-0.6B, 16k tokens): 1,150 -> 484 ms/step.

Backends, best first: torch's ``varlen_attn`` (torch >= 2.10, sm80+, bf16/fp16), flash-attn's varlen function,
flex_attention with one BlockMask per batch built from ``cu_seqlens`` (no dense T×T mask), and SDPA with a
block-diagonal mask built once per batch (CPU, older GPUs). With the cache off the model runs transformers' own
packed path, which is the baseline.

A row that holds one document needs no document mask, so it runs plain causal attention over the whole row: on
Hopper through cuDNN's fused kernel (``attention_backend`` auto, or cudnn on any GPU), which took 1.23 against
2.03 ms forward + backward per layer for the varlen kernel (H200, 4,096 tokens, 32 query and 8 K/V heads of 128;
benchmarks/attention_kernels_h200.md), elsewhere through the causal kernel SDPA picks. With a kernel named (varlen,
...), such a row runs through the packed rows' kernel, so varlen against auto compares the two kernels. cuDNN's
packed (ragged) mode is not used: torch 2.11's call into it returned non-finite outputs on the H200.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from engine.data.packing import PackedBatch
from engine.hardware.gpus import CUDNN_ATTENTION_MAJORS

ATTENTION_NAME = "tunedeck_packed"
"""Name under which the packed attention function is registered with transformers' AttentionInterface."""

METADATA_KWARG = "packed_metadata"
"""Model keyword argument that carries :class:`PackedAttentionMetadata` down to every attention call."""

BACKENDS = ("varlen", "flash_attn", "flex", "sdpa")
FLEX_BLOCK = 128


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str


def varlen_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when torch's varlen_attn can run here, else why not."""
    if device.type != "cuda":
        return "varlen_attn needs a CUDA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn runs in bf16/fp16, the model is {dtype}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "varlen_attn needs sm80 or newer"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return "this torch has no torch.nn.attention.varlen (needs torch >= 2.10)"
    return None


def flash_attn_available(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "flash-attn needs a CUDA GPU and bf16/fp16"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    return None


def flex_available(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return "flex_attention has no backward on CPU"
    if importlib.util.find_spec("triton") is None:
        return "flex_attention needs triton to compile its kernels"
    return None


def kernel_problems(device: torch.device, dtype: torch.dtype) -> dict[str, str | None]:
    """Each packed-attention backend's reason it cannot run on this device and dtype (None: it can)."""
    checks: dict[str, Callable[[torch.device, torch.dtype], str | None]] = {
        "varlen": varlen_available,
        "flash_attn": flash_attn_available,
        "flex": flex_available,
        "sdpa": lambda _device, _dtype: None,
    }
    return {name: checks[name](device, dtype) for name in BACKENDS}


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype) -> BackendChoice:
    """The best backend that runs on this device and dtype, honouring an explicit request when it can run."""
    return choose_backend_from(
        requested, kernel_problems(device, dtype), f"{device.type} {str(dtype).removeprefix('torch.')}"
    )


def choose_backend_from(requested: str, problems: Mapping[str, str | None], where: str) -> BackendChoice:
    """:func:`choose_backend` from each backend's problem (:func:`kernel_problems`); ``where``: e.g. "cuda
    bfloat16"."""
    if requested not in ("auto", "cudnn"):  # cudnn names the one-document rows' kernel: packed rows as auto
        problem = problems.get(requested, f"{requested} was not checked here")
        if problem is None:
            return BackendChoice(requested, f"{requested} requested")
        fallback = choose_backend_from("auto", problems, where)
        return BackendChoice(fallback.name, f"{requested} requested but {problem}; using {fallback.name}")
    skipped: list[str] = []
    for name in BACKENDS:
        problem = None if name == "sdpa" else problems.get(name, f"{name} was not checked here")
        if problem is None:
            why = f"best available backend for {where}"
            return BackendChoice(name, why + (f" ({'; '.join(skipped)})" if skipped else ""))
        skipped.append(problem)
    raise AssertionError("sdpa is always available")


@dataclass(eq=False)
class PackedAttentionMetadata:
    """One batch's document structure on the device, plus masks built lazily once per batch and window."""

    backend: str
    cu_seqlens: torch.Tensor
    """(D + 1,) int32 on the device."""
    max_seqlen: int
    document_ids: torch.Tensor
    """(T,) int32 on the device."""
    host_cu_seqlens: torch.Tensor
    num_tokens: int
    whole_row_causal: bool = False
    """One document fills the row, so plain causal attention over the whole row is exact and a dense causal kernel
    may run instead of the varlen one."""
    cudnn: bool = False
    """A whole row runs through cuDNN's fused kernel (:func:`cudnn_causal_attention`); else the one SDPA picks."""
    _masks: dict[int | None, Any] = field(default_factory=dict)

    def dense_mask(self, window: int | None) -> torch.Tensor:
        """(1, 1, T, T) boolean block-diagonal causal mask (True = may attend), built once per batch and window."""
        if window not in self._masks:
            self._masks[window] = block_diagonal_mask(self.document_ids, window)
        return cast(torch.Tensor, self._masks[window])

    def block_mask(self, window: int | None) -> Any:
        """flex_attention BlockMask, built once per batch and window from the host-side cu_seqlens."""
        if window not in self._masks:
            self._masks[window] = document_block_mask(self.host_cu_seqlens, self.document_ids, window)
        return self._masks[window]


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy that never blocks: pinned staging on CUDA, a plain move elsewhere."""
    if device.type != "cuda":
        return tensor.to(device)
    if tensor.is_cuda:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def build_metadata(
    batch: PackedBatch, device: torch.device, backend: str, whole_row: bool = False, cudnn: bool = False
) -> PackedAttentionMetadata:
    """Upload one batch's metadata (``batch`` may already be on the device; cu_seqlens stays host-side).

    ``whole_row``: a row holding a single document takes a dense causal kernel instead of ``backend`` (the
    automatic backend choice allows it; an explicitly requested backend is kept): cuDNN's where ``cudnn``, else
    the one SDPA picks."""
    if batch.input_ids.shape[0] != 1:
        raise ValueError("packed attention expects one packed row per micro-batch")
    host_cu = batch.cu_seqlens.to("cpu", torch.int32)
    return PackedAttentionMetadata(
        backend=backend,
        cu_seqlens=upload(host_cu, device),
        max_seqlen=int(batch.max_seqlen),
        document_ids=upload(batch.document_ids.reshape(-1), device),
        host_cu_seqlens=host_cu,
        num_tokens=batch.num_tokens,
        whole_row_causal=whole_row and host_cu.numel() == 2,
        cudnn=cudnn,
    )


def block_diagonal_mask(document_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """Token q sees token k iff same document, k <= q, and (with a window) q - k < window."""
    ids = document_ids.reshape(-1)
    positions = torch.arange(ids.numel(), device=ids.device)
    allowed = (ids[:, None] == ids[None, :]) & (positions[None, :] <= positions[:, None])
    if window is not None:
        allowed &= positions[:, None] - positions[None, :] < window
    return allowed[None, None]


def document_kv_blocks(
    cu_seqlens: torch.Tensor, num_tokens: int, window: int | None, block: int = FLEX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (q block, kv block): does any pair attend (partial or full), and do all pairs attend (full).

    Works on the host from cu_seqlens alone, in O(blocks²) booleans instead of the O(T²) dense mask.
    """
    nb = -(-num_tokens // block)
    starts = torch.arange(nb) * block
    ends = torch.clamp(starts + block, max=num_tokens) - 1  # last token of each block
    doc_of = torch.searchsorted(cu_seqlens.to(torch.int64), torch.arange(num_tokens), right=True) - 1
    doc_start = cu_seqlens.to(torch.int64)[doc_of]
    # The earliest key a query block can see: the start of its first token's document (or its window edge).
    earliest = doc_start[starts]
    if window is not None:
        earliest = torch.maximum(earliest, starts - window + 1)
    q = torch.arange(nb)[:, None]
    kv = torch.arange(nb)[None, :]
    any_pair = (kv <= q) & (ends[None, :] >= earliest[:, None])
    same_doc = doc_of[starts][None, :] == doc_of[ends][:, None]  # first key and last query share a document
    full = any_pair & (kv < q) & same_doc
    if window is not None:
        full &= ends[:, None] - starts[None, :] < window
    return any_pair, full


def _as_block_lists(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counts = pairs.sum(-1).to(torch.int32)
    # Stable sort puts the selected kv blocks first, in order; the tail is ignored past each row's count.
    indices = torch.argsort((~pairs).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def document_block_mask(host_cu_seqlens: torch.Tensor, document_ids: torch.Tensor, window: int | None) -> Any:
    """A flex_attention BlockMask for a packed row, built from block lists (never a dense T×T mask)."""
    from torch.nn.attention.flex_attention import BlockMask

    num_tokens = int(document_ids.numel())
    any_pair, full = document_kv_blocks(host_cu_seqlens, num_tokens, window)
    partial_counts, partial_indices = _as_block_lists(any_pair & ~full)
    full_counts, full_indices = _as_block_lists(full)
    docs = document_ids

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        allowed = (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        return allowed

    device = document_ids.device
    return BlockMask.from_kv_blocks(
        upload(partial_counts, device),
        upload(partial_indices, device),
        upload(full_counts, device),
        upload(full_indices, device),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(num_tokens, num_tokens),
    )


def _repeat_kv(states: torch.Tensor, groups: int, head_dim: int = 1) -> torch.Tensor:
    """Repeat key/value heads for grouped-query attention (kernels without native GQA)."""
    if groups == 1:
        return states
    return states.repeat_interleave(groups, dim=head_dim)


_VARLEN_PARAMS: dict[str, frozenset[str]] = {}
"""varlen_attn's keyword names, read once. A plain dict rather than ``functools.cache``: this is read inside
compiled layers, where Dynamo warns that it ignores an lru_cache wrapper and traces the function itself."""


def _varlen_params() -> frozenset[str]:
    """varlen_attn's keyword names: torch 2.10/2.11 lack ``enable_gqa`` (added in 2.12)."""
    if "names" not in _VARLEN_PARAMS:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMS["names"] = frozenset(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMS["names"]


def grouped_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedAttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """q (T, H, D), k/v (T, H_kv, D) -> (T, H, D) through the FlashAttention-2 kernel varlen_attn wraps, called
    with the grouped K/V as they are.

    The kernel serves each K/V head to its group of query heads itself; only torch 2.12's varlen_attn exposes that
    (``enable_gqa``). Repeating K/V to every head instead keeps the repeated copies for backward and reduces their
    gradients after it: on Llama-3.2-1B at 16,384 tokens (32 query heads, 8 K/V heads) 96 MiB more per layer.
    The op's own derivative runs the matching backward kernel, which returns grouped K/V gradients.
    """
    cu, n = meta.cu_seqlens, meta.max_seqlen
    left = -1 if window is None else window - 1
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale, window_size_left=left, window_size_right=0
    )
    return cast(torch.Tensor, out[0])


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedAttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """q (T, H, D), k/v (T, H_kv, D) -> (T, H, D) with torch's varlen_attn (FA2 kernels, causal within each
    document); grouped K/V or a sliding window that this torch's varlen_attn cannot take go to the same kernel
    through :func:`grouped_flash_attention`, never repeated."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    grouped = q.shape[1] != k.shape[1]
    if (grouped and "enable_gqa" not in params) or (window is not None and "window_size" not in params):
        return grouped_flash_attention(q, k, v, meta, scale, window)
    extra: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        extra["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        extra["is_causal"] = True
    if grouped:
        extra["enable_gqa"] = True
    cu, n = meta.cu_seqlens, meta.max_seqlen
    out = varlen_attn(q, k, v, cu, cu, n, n, **extra)
    return out[0] if isinstance(out, tuple) else out  # a tuple only when auxiliary outputs are asked for


CUDNN_MAX_HEAD_DIM = 128
"""The widest attention head the cuDNN path is used for (its fused kernel's forward and backward both run there)."""


def cudnn_width_ok(width: int) -> bool:
    """Heads cuDNN's fused kernel is used for: at most 128 wide, a multiple of 8."""
    return width <= CUDNN_MAX_HEAD_DIM and width % 8 == 0


def cudnn_takes(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether cuDNN's fused kernel serves these heads: equal query and value widths it is used for."""
    width = query.shape[-1]
    return width == value.shape[-1] and cudnn_width_ok(width)


def cudnn_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, T, D) queries, (B, H_kv, T, D) keys and values -> (B, H, T, D): causal attention over the whole row in
    cuDNN's fused kernel, which serves each K/V head to its group of query heads itself. Called as the op SDPA's
    cuDNN backend runs, so the kernel does not depend on SDPA's own choice, which differs between torch versions
    and cards (torch 2.11 picks this kernel on the H200 by itself)."""
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    return cast(torch.Tensor, cudnn(query, key, value, None, True, 0.0, True, False, scale=scale)[0])


def cudnn_problem(
    device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, head_dim: int, has_cudnn: bool
) -> str | None:
    """Why cuDNN's fused attention cannot serve this model here (None when it can)."""
    if device_type != "cuda":
        return "cuDNN attention needs a CUDA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN attention runs in bf16/fp16, the model is {str(dtype).removeprefix('torch.')}"
    if not has_cudnn:
        return "this torch build has no cuDNN"
    if capability is None or capability < (8, 0):
        return "cuDNN attention needs sm80 or newer"
    if not cudnn_width_ok(head_dim):
        return f"attention heads of {head_dim} (the cuDNN path takes up to {CUDNN_MAX_HEAD_DIM}, a multiple of 8)"
    return None


def resolve_cudnn(backend: str, problem: str | None, capability: tuple[int, int] | None) -> tuple[bool, str]:
    """(on, why) of cuDNN's kernel for rows holding one document (packed rows keep the packed kernel), from the
    ``attention_backend`` setting: ``cudnn`` asks for it wherever it runs; ``auto`` takes it where it was measured
    (Hopper), elsewhere such a row takes the causal kernel SDPA picks; a kernel asked for by name serves every row."""
    if backend not in ("auto", "cudnn"):
        return False, f"every row takes the {backend} kernel asked for"
    if problem is not None:
        return False, problem
    if backend == "cudnn":
        return True, "asked for: a one-document row runs through cuDNN's fused causal kernel"
    major = capability[0] if capability else 0
    if major in CUDNN_ATTENTION_MAJORS:
        how = "a one-document row runs through cuDNN's fused causal kernel (1.6x FlashAttention-2's on the H200)"
        return True, f"automatic: {how}"
    return False, (
        f"automatic: off on sm_{major}x, where it is not measured (a one-document row takes the causal kernel SDPA "
        "picks); set the attention backend to cudnn to try cuDNN's on this GPU"
    )


def flash_attn_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PackedAttentionMetadata,
    scale: float,
    window: int | None,
    dropout: float,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    cu, n = meta.cu_seqlens, meta.max_seqlen
    left = -1 if window is None else window - 1
    out: torch.Tensor = flash_attn_varlen_func(
        q, k, v, cu, cu, n, n, dropout_p=dropout, softmax_scale=scale, causal=True, window_size=(left, 0)
    )
    return out


_COMPILED_FLEX: dict[str, Callable[..., Any]] = {}
"""flex_attention compiled once, for eager callers on CUDA. A plain dict for the same reason as ``_VARLEN_PARAMS``."""


def _flex_attention_for(q: torch.Tensor) -> Callable[..., Any]:
    """flex_attention as ``q``'s caller should run it: compiled on CUDA (eager flex is a dense reference
    implementation), as it is inside a compiled layer (whose compile lowers it to its kernel), else eager."""
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda or torch.compiler.is_compiling():
        return flex_attention
    if "fn" not in _COMPILED_FLEX:
        _COMPILED_FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX["fn"]


def flex_attention_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedAttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """q/k/v (1, H, T, D) -> (1, H, T, D). Compiled on CUDA (eager flex is a dense reference implementation)."""
    fn: Any = _flex_attention_for(q)
    groups = q.shape[1] // k.shape[1]
    return cast(torch.Tensor, fn(q, k, v, block_mask=meta.block_mask(window), scale=scale, enable_gqa=groups > 1))


def sdpa_attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PackedAttentionMetadata,
    scale: float,
    window: int | None,
    dropout: float,
) -> torch.Tensor:
    """q/k/v (1, H, T, D) -> (1, H, T, D) with SDPA and the batch's block-diagonal mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    mask = meta.dense_mask(window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (1, H, T, D) inputs, returns ((1, T, H, D), None).

    Reads the batch's metadata from the ``packed_metadata`` keyword argument. Without it (a call that did not go
    through the speed controller: generation with its KV cache and left padding, an evaluation) it is transformers'
    own SDPA attention, with the mask transformers built (boolean or additive) and its causal rule.
    """
    meta: PackedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scale,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row per micro-batch")
    if meta.whole_row_causal and sliding_window is None:
        if meta.cudnn and dropout == 0 and cudnn_takes(query, value):
            out = cudnn_causal_attention(query, key, value, scale)
        else:
            groups = query.shape[1] // key.shape[1]
            out = F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=groups > 1
            )
        return out.transpose(1, 2).contiguous(), None
    backend = meta.backend
    if dropout > 0 and backend in ("varlen", "flex"):
        backend = "sdpa"  # neither kernel has attention dropout
    if backend in ("varlen", "flash_attn"):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        if backend == "varlen":
            out = varlen_attention(q, k, v, meta, scale, sliding_window)
        else:
            out = flash_attn_attention(q, k, v, meta, scale, sliding_window, dropout)
        return out.unsqueeze(0), None
    if backend == "flex":
        out = flex_attention_call(query, key, value, meta, scale, sliding_window)
    else:
        out = sdpa_attention_call(query, key, value, meta, scale, sliding_window, dropout)
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> None:
    """Register the packed attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        _varlen_params()  # read the signature now, outside any compiled region


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model's attention cannot take the packed path (None when it can)."""
    config = getattr(model, "config", None)
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping has no varlen kernel"
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return "attention sinks (gpt-oss) have no varlen kernel; its explicit per-batch masks stay"
    return None


def packed_inputs(stock_inputs: dict[str, Any], meta: PackedAttentionMetadata) -> dict[str, Any]:
    """Model kwargs for the packed path: the stock ones (ids, positions, no cache) plus the metadata."""
    inputs = {key: value for key, value in stock_inputs.items() if key != "attention_mask"}
    inputs[METADATA_KWARG] = meta
    return inputs
