"""Fused per-token operations: each decoder layer's attention, MLP and norms compiled by ``torch.compile``.

Why: between its matmuls a decoder layer runs dozens of small element-wise kernels, each reading and writing
the whole (tokens × hidden) activation: RMSNorm alone is a cast, a square, a mean, an add, a reciprocal square
root, two multiplies and a cast back; rotary embeddings slice, negate, concatenate and multiply-add q and k;
SwiGLU is a SiLU and a product; every LoRA projection adds ``B(A(x)) · scale`` to its base output. At 16k tokens
these memory-bound kernels take a large share of a step on a big GPU. Inductor fuses each run of them into one
Triton kernel, around the same cuBLAS matmuls and the same attention kernel.

Regional: the compiled regions are the children of each decoder layer (attention with its LoRA projections,
q/k norms and rotary; the MLP with its LoRA projections and SwiGLU; the two norms), never the whole model.
Parameters are graph inputs, so one graph per module class serves every layer and compile time does not grow
with depth. transformers wraps the layer's own forward in the gradient-checkpointing function, so compiling
below the layer keeps both checkpoint functions (standard and offloaded) outside the graphs, recomputing
compiled children; the price is that the two residual adds per layer stay eager, and four compiled calls per
layer and pass, each with its host-side guards and wrapper. Whole decoder layers as single regions (the checkpoint
call routed around them) measured slower on the H200: 592 against 410 ms a QLoRA step
(``benchmarks/qlora_layer_regions_h200.md``), so there are none.

Dynamic shapes: regions compile with ``dynamic=True``, so the token count, the number of documents
(``cu_seqlens``) and ``max_seqlen`` are symbolic: packed rows of any length reuse the same graphs, with no
recompile from step to step. The attention metadata's masks are built before the layers run.

The fused loss's per-chunk softmax gradient is compiled under this switch too
(:func:`engine.speed.fused_loss.compiled_softmax_cross_entropy_grad`): one reduction and one element-wise pass over
the chunk's 16-bit logits instead of seven float32 passes (39 ms of a 244 ms Llama-3.2-1B step on the H200).

4-bit (QLoRA) layers compile too: bitsandbytes registers its dequantize and 4-bit matmul as torch custom ops, so
the NF4 projections stay in the graphs (Llama-3.1-8B shape, NF4, LoRA r32, one 4,096-token row under offloaded
checkpointing on the H200: 10 graphs, no graph break, 592 -> 449 ms/step).

Switching: on sets each region's ``_compiled_call_impl`` (what ``nn.Module.compile`` sets), off clears it, so
``nn.Module.__call__`` runs the eager reference path again; no reload, no reassigned library method. Compiled
code stays cached, so switching back on costs nothing. The first step after switching on compiles: 72-75 s for
Llama-3.2-1B / Qwen3-0.6B on the H200 machine's 16 cores (9 graphs, no graph break, no recompile afterwards);
on CPU inductor compiles slowly and gains little, so automatic is on only for CUDA with triton. Measured there
(16k-token row): Qwen3-0.6B 1,149 -> 921 ms/step with this switch alone, and all switches together 184.0 ms
against 1,150.9 ms stock, Llama-3.2-1B 213.3 against 887.8 ms (benchmarks/speed_h200.md).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["RegionCompiler", "compile_regions", "decoder_layers", "prepare_metadata", "resolve", "unsupported_reason"]


def decoder_layers(hf_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder layers (transformers marks them as gradient-checkpointing layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in hf_model.modules() if isinstance(module, GradientCheckpointingLayer)]


def compile_regions(hf_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that get compiled: every direct child of every decoder layer.

    Under the chunked MLP switch a child runs in sequence chunks (``TokenChunked``): then the module it wraps is
    compiled and called once per chunk, and an attention block whose projections are chunked compiles just those
    projections (their LoRA paths), leaving its q/k norms and rotary eager.
    """
    from engine.speed.chunked_mlp import TokenChunked

    regions: list[torch.nn.Module] = []
    for layer in decoder_layers(hf_model):
        for child in layer.children():
            chunked = [module.wrapped for module in child.modules() if isinstance(module, TokenChunked)]
            regions.extend(chunked or [child])
    return regions


def _eight_bit(hf_model: torch.nn.Module) -> bool:
    """bitsandbytes 8-bit layers (LLM.int8): their outlier handling has not been verified under compile; the
    4-bit layers' dequantize and matmul ops are torch custom ops that compile without graph breaks."""
    return any(type(module).__name__ == "Linear8bitLt" for module in hf_model.modules())


def _has_experts(hf_model: torch.nn.Module) -> bool:
    from engine.speed import moe_routing

    return moe_routing.has_routable_experts(hf_model)


def unsupported_reason(hf_model: torch.nn.Module) -> str | None:
    """Why this model's layers cannot be compiled at all (None when they can)."""
    if not decoder_layers(hf_model):
        return f"{type(hf_model).__name__} has no transformers decoder layers to compile"
    return None


def automatic(hf_model: torch.nn.Module, device: torch.device) -> tuple[bool, str]:
    """The automatic choice and its reason."""
    if device.type != "cuda":
        return False, "automatic: off on CPU (inductor's CPU compile takes ~15 s per model and gains little)"
    if importlib.util.find_spec("triton") is None:
        return False, "automatic: off, triton is not installed (inductor generates Triton kernels for GPUs)"
    if _eight_bit(hf_model):
        return False, "automatic: off, bitsandbytes 8-bit layers are not verified under torch.compile"
    if _has_experts(hf_model):
        return False, "automatic: off, MoE expert layers are not verified under torch.compile"
    return True, "automatic: norms, rotary, SwiGLU and LoRA paths fused per layer by torch.compile (Triton)"


def resolve(requested: bool | None, hf_model: torch.nn.Module, device: torch.device) -> tuple[bool, str]:
    """(on, reason) for the switch's setting on this model and device (:func:`resolve_from`)."""
    return resolve_from(requested, unsupported_reason(hf_model), automatic(hf_model, device))


def resolve_from(requested: bool | None, problem: str | None, automatic_choice: tuple[bool, str]) -> tuple[bool, str]:
    """(on, reason) for the switch's setting: True / False as asked (when possible), None automatic; ``problem``:
    :func:`unsupported_reason`, ``automatic_choice``: :func:`automatic`."""
    if requested is False:
        return False, "switched off: every layer runs eagerly (the reference path)"
    if problem is not None:
        return False, problem
    if requested is None:
        return automatic_choice
    return True, "switched on; norms, rotary, SwiGLU and LoRA paths fused per layer by torch.compile"


class RegionCompiler:
    """Swaps compiled forwards of a model's layer regions in and out; compiled code is kept for reuse."""

    RECOMPILE_LIMIT = 64
    """Graphs kept per region. Each region legitimately compiles several (forward without gradients, recompute,
    no checkpointing; each combination of switches that changes the modules inside it, flipped live); past
    Dynamo's default of 8 it would silently fall back to eager code for the rest of the run."""

    def __init__(self, backend: str | Callable[..., Any] = "inductor") -> None:
        self.backend = backend
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, self.RECOMPILE_LIMIT)
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self._active: list[torch.nn.Module] = []

    def switch(self, hf_model: torch.nn.Module, on: bool) -> None:
        """Compile (on) or restore the eager forward (off) of every region; safe between any two steps.

        Idempotent; call it again after the set of regions changed (the chunked MLP or checkpointing switched).
        """
        wanted = compile_regions(hf_model) if on else []
        keep = {id(region) for region in wanted}
        for region in self._active:
            if id(region) not in keep:
                region._compiled_call_impl = None
        for region in wanted:
            region._compiled_call_impl = self._compiled_for(region)
        self._active = wanted

    def _compiled_for(self, region: torch.nn.Module) -> Callable[..., Any]:
        if region not in self._compiled:
            self._compiled[region] = torch.compile(region._call_impl, backend=self.backend, dynamic=True)
        return self._compiled[region]


def _sliding_window(hf_model: torch.nn.Module) -> int | None:
    config = cast("PreTrainedModel", hf_model).config.get_text_config()
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return getattr(config, "sliding_window", None)
    return None


def prepare_metadata(meta: Any, hf_model: torch.nn.Module) -> None:
    """Build the batch's attention masks (flex, sdpa backends) before the compiled layers read them.

    Built lazily inside the first compiled attention call they would put host-side work (and a pinned upload)
    into the graph; built here they are plain inputs.
    """
    windows = {None, _sliding_window(hf_model)}
    if meta.whole_row_causal:
        windows.discard(None)  # the whole row is plain causal attention: no mask
    for window in windows:
        if meta.backend == "flex":
            meta.block_mask(window)
        elif meta.backend == "sdpa":
            meta.dense_mask(window)


def transformers_model(model: torch.nn.Module) -> Any:
    """The transformers PreTrainedModel inside a peft wrapper (or the model itself)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"{type(model).__name__} contains no transformers model")
