"""Peak training memory from a model's shape, without loading it, and the largest batch that fits.

The estimate follows what the engine actually keeps alive, term by term, rather than a rule of thumb (a peer's
rule of thumb was 2-5x off). One packed row of T tokens; the peak is the larger of two moments:

* the start of backward, at the loss: every activation saved by the decoder layers (or, with checkpointing,
  only each layer's input) plus the loss's working set. Stock cross-entropy keeps 12 bytes per token and
  vocabulary entry (log-softmax output, its incoming gradient and its input gradient, all fp32): with
  vocabularies of 128k-152k that dominates long rows, 12 x 16k x 152k = 30 GB for Qwen3-0.6B. The engine's fused
  loss (on by default, ``TrainSetup.fused_loss``) keeps only the hidden-state gradient plus one chunk of logits;
* with checkpointing, the recompute of one layer in backward: that layer's activations plus its gradients. Long
  rows run the MLP (and, with eager layers, every per-token module) in chunks of the sequence
  (``TrainSetup.chunk_tokens``, :func:`chunk_split`): its intermediates and their gradients exist for one chunk,
  and the attention kernel's backward buffers (a float32 query-gradient accumulator) decide the peak instead.

Per-layer activation bytes were counted from the tensors autograd saves (``saved_tensors_hooks``) for
transformers + peft: peft keeps LoRA weights in fp32 and casts each adapted module's 16-bit input to fp32
separately (4 bytes x every adapted input width per token); RMSNorm keeps an fp32 copy of its input. The
engine's QLoRA path keeps embeddings, norms and the output head in the 16-bit compute dtype
(:func:`engine.model.load.prepare_quantized_for_training`); ``TrainSetup.kbit_upcast`` models peft's
``prepare_model_for_kbit_training`` instead, which upcasts them to fp32, so that the whole residual stream, and
every activation, is fp32 (what the 8B QLoRA rows of ``benchmarks/planner_accuracy.md`` measured).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.hardware import checkpoint_choice
from engine.hardware.checkpoint_choice import Checkpointing
from engine.hardware.shapes import ModelShape

GIB = 1 << 30
MIB = 1 << 20

Optimizer = Literal["adamw", "adamw8bit", "sgd"]
AttentionBackend = Literal["varlen", "flash_attn", "flex", "sdpa"]
ChunkScope = Literal["all", "mlp"]

OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "adamw8bit": 2, "sgd": 0}
LORA_PARAM_BYTES = 4
"""peft keeps adapter weights (and so their gradients) in fp32 on a 16-bit base model."""
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
"""4-bit codes, one uint8 absmax per 64 weights, one fp32 per 256 absmax values (double quantization)."""
CROSS_ENTROPY_BYTES_PER_LOGIT = 12
"""fp32 log-softmax output + the gradient arriving from nll_loss + the gradient it produces."""
FUSED_CHUNK_LOGIT_BYTES = 256 * MIB
"""engine.speed.fused_loss.CHUNK_LOGIT_BYTES: fp32 logits of one chunk of tokens."""
OFFLOAD_RING = 3
"""Layer inputs the offloaded mode keeps on the GPU at once: two in-flight copies plus the one in use."""
MIN_OFFLOAD_BYTES = 8 * MIB
"""Below this per-layer input size the engine recomputes without offloading (engine.speed)."""
FIXED_OVERHEAD_BYTES = 32 * MIB
"""cuBLAS workspaces, rotary tables, ids and labels (measured: the rest of the step is within ~0.1 GiB)."""
CONTEXT_BYTES = int(0.5 * GIB)
"""CUDA context and kernels outside the allocator (not counted by max_memory_allocated)."""
SAFETY_MARGIN = 0.10
"""Headroom over the estimate for allocator fragmentation and estimation error when fitting a batch."""
CHUNK_BYTES = 256 * MIB
"""Working set one chunk of a chunked MLP may take (engine.speed.chunked_mlp): small beside an 8 GiB card's 1-2 GiB
of activations, large enough that every matmul stays big (measured on the H200: 4,096-token chunks of the 8B MLP
took 0.9 GiB, and at 8 GiB that one transient decided the longest row)."""
MIN_CHUNK_TOKENS = 1024
MAX_CHUNK_TOKENS = 8192
CHUNK_MIN_ROW_TOKENS = 8192
"""The engine chunks automatically only rows longer than this (and only under checkpointing, when memory is
short): below it one layer's MLP activations are a few hundred MB even for an 8B model, and the extra recompute
is not worth it (measured on the H200, 8B QLoRA at 32k tokens with 4,096-token chunks: 8.8 -> 13.7 s per step,
18.8 -> 10.0 GiB peak)."""


CHUNK_FREE_SHARE = 0.25
"""Automatic chunking waits until memory is short: the engine chunks only where one layer's unchunked per-token work
would take more than this share of the memory free after the weights and the adapter (engine.speed.chunked_mlp)."""


def row_working_bytes(shape: ModelShape, tokens: int) -> int:
    """What one layer's per-token modules hold for a whole row of ``tokens`` without chunking (as
    :func:`chunk_tokens_for` counts a token)."""
    return tokens * (10 * shape.intermediate_size + 8 * shape.hidden_size)


def chunk_tokens_for(intermediate_size: int, hidden_size: int) -> int | None:
    """Tokens per chunk of the engine's chunked MLP, so that one chunk's working set stays near CHUNK_BYTES.

    Per token: gate, up and activation outputs in 16-bit (6 x intermediate), the float32 copy of the down
    projection's input that its LoRA adapter saves (4 x intermediate), and the gate and up adapters' float32
    copies of the hidden state (8 x hidden). Llama-3.1-8B: 176 KB per token, 1,024-token chunks; Qwen3-0.6B:
    39 KB, 6,656-token chunks. The float32 terms are peft's path; with 16-bit LoRA (the default on GPUs) the
    chunk's working set is smaller and the size errs on the safe side (the 8 GiB long-context row was measured
    with it). None when the widths are unknown.
    """
    per_token = 10 * intermediate_size + 8 * hidden_size
    if per_token <= 0:
        return None
    tokens = CHUNK_BYTES // per_token // 512 * 512
    return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, tokens))


@dataclass(frozen=True)
class TrainSetup:
    """The choices that change training memory."""

    tokens: int = 4096
    qlora: bool = False
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    checkpointing: Checkpointing = "none"
    optimizer: Optimizer = "adamw"
    dtype_bytes: int = 2
    """2 for bf16/fp16 training, 4 for fp32 (CPU)."""
    attention: AttentionBackend = "varlen"
    """The attention kernel requested; see :func:`effective_attention` for what runs."""
    fused_loss: bool = True
    """The engine's chunked linear cross-entropy (engine.speed.fused_loss) rather than stock's full fp32 logits."""
    kbit_upcast: bool = False
    """QLoRA through peft's prepare_model_for_kbit_training (non-4-bit weights and all activations in fp32) rather
    than the engine's own preparation, which keeps them in the compute dtype (Llama-3.1-8B at 256 tokens:
    ~9.3 GiB with the upcast, ~6.6 GiB without)."""
    lora_16bit: bool = True
    """LoRA computed in the 16-bit training dtype (engine.speed.lora_16bit): adapted modules share their 16-bit
    inputs instead of each keeping a float32 copy."""
    native_gqa: bool = True
    """The varlen kernel takes grouped K/V as they are (the engine's path); False models a path that repeats them
    to all query heads first, as stock's SDPA does."""
    chunk_tokens: int | None = None
    """Per-token modules run over chunks of this many tokens under checkpointing (engine.speed.chunked_mlp);
    None: over whole rows."""
    chunk_min_tokens: int = 0
    """Only rows longer than this are chunked (the engine's automatic mode: CHUNK_MIN_ROW_TOKENS)."""
    chunk_budget_bytes: int | None = None
    """With automatic chunking (``chunk_min_tokens`` > 0), the memory budget of the engine's rule: a row is chunked
    only where :func:`row_working_bytes` exceeds :data:`CHUNK_FREE_SHARE` of what the budget leaves after the
    weights and the adapter. None: every row longer than ``chunk_min_tokens`` is chunked."""
    chunk_scope: ChunkScope = "all"
    """What runs in chunks: every per-token module (eager layers) or only the MLP (compiled layers)."""
    host_embedding: bool = False
    """The input embedding table lives in host memory (engine.speed.host_embedding)."""
    dequant_once: bool = False
    """4-bit weights dequantized once per recompute and kept for backward (engine.speed.lean_recompute): one
    layer's 16-bit projections, but the MLP's down projection, are alive while it recomputes and runs backward."""
    resident_layers: int = 0
    """Under checkpointing, this many layers keep their activations on the GPU and skip the recompute
    (engine.speed.resident_layers)."""

    @property
    def activation_bytes(self) -> int:
        return 4 if self.qlora and self.kbit_upcast else self.dtype_bytes

    def with_tokens(self, tokens: int) -> TrainSetup:
        return replace(self, tokens=tokens)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak allocator memory (bytes) of one training step, and what makes it up."""

    weights: int
    adapter: int
    activations: int
    loss: int
    recompute: int
    attention_masks: int
    overhead: int
    attention: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        at_loss = self.activations + self.loss
        return self.weights + self.adapter + self.overhead + self.attention_masks + max(at_loss, self.recompute)

    def gib(self) -> float:
        return self.peak / GIB

    def breakdown(self) -> list[tuple[str, int]]:
        """What fills the peak, largest first; the parts add up to :attr:`peak`. Of the two moments a step peaks at
        (module docstring), the one that decides it is listed."""
        at_loss = self.activations + self.loss
        moment = (
            [("activations kept for backward", self.activations), ("loss and logits", self.loss)]
            if at_loss >= self.recompute
            else [("checkpointed layer inputs and one layer's recompute and gradients", self.recompute)]
        )
        parts = [
            ("weights", self.weights),
            ("LoRA adapter, its gradients and optimizer state", self.adapter),
            *moment,
            ("attention masks", self.attention_masks),
            ("workspaces", self.overhead),
        ]
        return sorted(((name, size) for name, size in parts if size > 0), key=lambda part: -part[1])

    def breakdown_text(self) -> str:
        """The breakdown in words: "activations kept for backward 19.4 GiB, weights 1.1 GiB, ..."."""
        shown = [(name, size) for name, size in self.breakdown() if size >= GIB // 20]  # what rounds to 0.0 is left out
        return ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in shown)


def effective_attention(setup: TrainSetup, compute_capability: tuple[int, int] | None) -> str:
    """The kernel the engine will run (its metadata cache falls back the same way): varlen and flash-attn need
    16-bit activations on sm80+; flex needs a GPU; sdpa always runs."""
    requested = setup.attention
    sixteen_bit = setup.activation_bytes == 2
    on_gpu = compute_capability is not None
    if (
        requested in ("varlen", "flash_attn")
        and sixteen_bit
        and compute_capability is not None
        and compute_capability >= (8, 0)
    ):
        return requested
    if requested in ("varlen", "flash_attn", "flex") and on_gpu:
        return "flex"
    return "sdpa"


def _adapted(shape: ModelShape, targets: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """(name, fan-in, fan-out) of each adapted linear; asked for about a million times planning the gallery."""
    return _adapted_linears(shape, tuple(targets))


@functools.lru_cache(maxsize=1024)
def _adapted_linears(shape: ModelShape, targets: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
    linears = shape.linear_layers()
    chosen = linears if "all-linear" in targets else tuple(lin for lin in linears if lin.name in targets)
    return tuple((lin.name, lin.in_features, lin.out_features) for lin in chosen)


def lora_params(shape: ModelShape, setup: TrainSetup) -> int:
    per_layer = sum(setup.lora_rank * (fan_in + fan_out) for _, fan_in, fan_out in _adapted(shape, setup.lora_targets))
    return shape.num_layers * per_layer


def weight_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Frozen base weights: NF4 for the linears and the MoE experts under QLoRA (engine.model.quantized_experts),
    else the training dtype (fp32 if upcast)."""
    quantized = shape.num_layers * (shape.linear_params_per_layer() + shape.expert_params_per_layer())
    other = shape.embedding_params() + shape.num_layers * shape.norm_params_per_layer() + shape.hidden_size
    if setup.qlora:
        other_bytes = 4 if setup.kbit_upcast else setup.dtype_bytes
        return int(quantized * NF4_BYTES_PER_PARAM) + other * other_bytes
    return (quantized + other) * setup.dtype_bytes


def experts_rerun_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Per token: 4-bit experts run their forward again inside backward to get the input gradient
    (engine.model.quantized_experts): one layer's routed activations exist there, and their gradients while
    autograd runs back through them."""
    return 2 * _routed_bytes(shape, setup) if setup.qlora and shape.is_moe else 0


def dequantized_experts_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """One MoE layer's experts in 16-bit: 4-bit experts are dequantized per layer while it runs forward or
    backward (engine.model.quantized_experts); nothing without QLoRA or for dense models."""
    if not (setup.qlora and shape.is_moe):
        return 0
    return shape.expert_params_per_layer() * setup.dtype_bytes


def setup_from_speed_state(
    state: Mapping[str, Mapping[str, Any]], shape: ModelShape, tokens: int, **fixed: Any
) -> TrainSetup:
    """The setup to plan for a step that ran with the speed switches in ``state`` (``SpeedController.state()``,
    as runs and benchmarks record it); ``fixed`` sets the rest (qlora, lora_rank, ...)."""

    def on(name: str) -> bool:
        return bool(state.get(name, {}).get("on", False))

    cache = state.get("metadata_cache", {})
    return TrainSetup(
        tokens=tokens,
        checkpointing=state.get("checkpointing", {}).get("mode", "none"),
        fused_loss=on("fused_loss"),
        lora_16bit=on("lora_16bit"),
        host_embedding=on("host_embedding"),
        dequant_once=on("dequant_once"),
        resident_layers=int(state.get("resident_layers", {}).get("layers", 0)),
        attention=cache.get("backend") if cache.get("on") else "sdpa",  # type: ignore[arg-type]
        chunk_tokens=chunk_tokens_for(shape.intermediate_size, shape.hidden_size) if on("chunked_mlp") else None,
        chunk_scope="mlp" if on("fused_kernels") else "all",
        **fixed,
    )


def state_peak_bytes(
    shape: ModelShape,
    state: Mapping[str, Mapping[str, Any]],
    tokens: int,
    compute_capability: tuple[int, int] | None = (9, 0),
    **fixed: Any,
) -> int:
    """Predicted peak of a step that ran with the speed switches in ``state`` (:func:`setup_from_speed_state`)."""
    return estimate_memory(shape, setup_from_speed_state(state, shape, tokens, **fixed), compute_capability).peak


AUTO_TABLE_SHARE = 0.08
"""The engine's automatic host embedding (engine.speed.host_embedding) moves the input embedding table to host
memory when it would take more than this share of the GPU memory a process may use."""


def table_crowds_card(table_bytes: int, usable: int) -> bool:
    """Whether an input embedding table of ``table_bytes`` is more than :data:`AUTO_TABLE_SHARE` of ``usable``."""
    return table_bytes > AUTO_TABLE_SHARE * usable


def host_embedding_automatic(shape: ModelShape, dtype_bytes: int, usable: int) -> bool:
    """Whether the engine's automatic host embedding moves this model's table off a card with ``usable`` bytes."""
    return not shape.tied_embeddings and table_crowds_card(shape.vocab_size * shape.hidden_size * dtype_bytes, usable)


def host_embedding_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """What the input embedding table takes on the GPU: nothing to move when the output head shares it."""
    if shape.tied_embeddings:
        return 0
    return shape.vocab_size * shape.hidden_size * (4 if setup.qlora and setup.kbit_upcast else setup.dtype_bytes)


def adapter_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """LoRA weights, their gradients and the optimizer state."""
    return lora_params(shape, setup) * (2 * LORA_PARAM_BYTES + OPTIMIZER_STATE_BYTES[setup.optimizer])


def _lora_input_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Per token and layer: the inputs the adapters save for their weight gradients."""
    adapted = _adapted(shape, setup.lora_targets)
    act = setup.activation_bytes
    if act != LORA_PARAM_BYTES and not setup.lora_16bit:  # each adapted module keeps its own fp32 input copy
        return LORA_PARAM_BYTES * sum(fan_in for _, fan_in, _ in adapted)
    names = {name for name, _, _ in adapted}
    shared = 0  # same dtype: modules reading one tensor share it; o_proj's input is the saved attention output
    if names & {"q_proj", "k_proj", "v_proj"}:
        shared += shape.hidden_size
    if names & {"gate_proj", "up_proj", "router"}:
        shared += shape.hidden_size
    if "down_proj" in names:
        shared += shape.shared_expert_intermediate_size if shape.is_moe else shape.intermediate_size
    return act * shared


def _lora_compute_bytes(setup: TrainSetup) -> int:
    """Bytes per element the adapters compute in: the activations' with 16-bit LoRA, else float32."""
    return setup.activation_bytes if setup.lora_16bit else LORA_PARAM_BYTES


def lora_weight_copy_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Per layer: the 16-bit copies of the LoRA weights that 16-bit LoRA's matmuls keep for the backward."""
    if not setup.lora_16bit or setup.activation_bytes == LORA_PARAM_BYTES:
        return 0
    return lora_params(shape, setup) // shape.num_layers * setup.activation_bytes


def _attention_bytes(shape: ModelShape, setup: TrainSetup, backend: str) -> int:
    """Per token and layer: q, k, v (repeated to all heads where the kernel needs it), output, log-sum-exp."""
    act = setup.activation_bytes
    repeated = backend == "sdpa" or (backend == "varlen" and not setup.native_gqa)
    kv = shape.q_dim if repeated else shape.kv_dim
    return act * (2 * shape.q_dim + 2 * kv) + 4 * shape.num_heads


def _routed_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Per token: the routed experts' activations (each chosen expert's input, gate, up and activation outputs)."""
    act = setup.activation_bytes
    return shape.experts_per_token * (act * shape.hidden_size + 3 * act * shape.expert_intermediate_size)


ROUTING_BYTES_PER_CHOICE = 12
"""Per token and chosen expert: what 4-bit experts keep of the routing for their backward (an int64 index and a
float32 weight)."""


def _mlp_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """Per token and layer: what the MLP keeps for backward. 4-bit experts (engine.model.quantized_experts) keep only
    their input and the routing and run forward again in backward (:func:`experts_rerun_bytes`): measured on the
    H200, a Qwen3-30B-A3B QLoRA layer keeps 0.23-0.27 GiB at 4,096 tokens, where counting the routed activations
    gave 0.49. 16-bit experts keep each chosen expert's activations."""
    act = setup.activation_bytes
    if not shape.is_moe:
        return 3 * act * shape.intermediate_size  # gate output, up output, activation output
    shared = 3 * act * shape.shared_expert_intermediate_size
    router = 8 * shape.num_experts  # router logits and probabilities in fp32
    if setup.qlora:
        experts = act * shape.hidden_size + ROUTING_BYTES_PER_CHOICE * shape.experts_per_token
    else:
        experts = _routed_bytes(shape, setup)
    return experts + shared + router


def layer_activation_bytes(shape: ModelShape, setup: TrainSetup, backend: str) -> int:
    """Bytes autograd keeps per token for one decoder layer without checkpointing."""
    h = shape.hidden_size
    norms = 2 * (4 * h + 4)  # RMSNorm's fp32 input and its 1/rms
    qk_norm = 4 * (shape.q_dim + shape.kv_dim + shape.num_heads + shape.num_kv_heads) if shape.qk_norm else 0
    lora_hidden = _lora_compute_bytes(setup) * setup.lora_rank * len(_adapted(shape, setup.lora_targets))
    return (
        norms
        + _lora_input_bytes(shape, setup)
        + lora_hidden
        + qk_norm
        + _attention_bytes(shape, setup, backend)
        + _mlp_bytes(shape, setup)
    )


def resident_layer_bytes(shape: ModelShape, setup: TrainSetup, backend: str) -> int:
    """Per token: what a resident layer (engine.speed.resident_layers) keeps for its backward. An eager layer keeps
    :func:`layer_activation_bytes`; a dense layer compiled by the fused-kernels switch (``chunk_scope`` "mlp") keeps
    less, since its fused regions save their 16-bit inputs and recompute the rest in backward: each norm keeps its
    16-bit input and 1/rms instead of a float32 copy, and the fused SwiGLU keeps the gate and up outputs but not the
    activation of the gate beside them (measured on the H200, Llama-3.1-8B QLoRA at 4,096 tokens: 0.51 GiB a layer,
    133 KB a token; this gives 140 KB)."""
    eager = layer_activation_bytes(shape, setup, backend)
    if setup.chunk_scope != "mlp" or shape.is_moe:
        return eager
    act, h = setup.activation_bytes, shape.hidden_size
    float32_norms, sixteen_bit_norms = 2 * (4 * h + 4), 2 * (act * h + 4)
    return eager - float32_norms + sixteen_bit_norms - act * shape.intermediate_size


def _layer_backward_bytes(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """Per token: gradients alive while one layer runs backward, as (the MLP's, the hidden-size ones)."""
    act = setup.activation_bytes
    width = shape.intermediate_size if not shape.is_moe else shape.experts_per_token * shape.expert_intermediate_size
    lora_output_grad = 0 if setup.lora_16bit or act == LORA_PARAM_BYTES else LORA_PARAM_BYTES
    return (3 * act + lora_output_grad) * width, 3 * act * shape.hidden_size


def _chunks(shape: ModelShape, setup: TrainSetup) -> bool:
    """Whether the row runs its per-token modules in chunks (dense MLPs; MoE experts are never chunked)."""
    chunk = setup.chunk_tokens
    if not chunk or setup.tokens <= max(chunk, setup.chunk_min_tokens) or shape.is_moe:
        return False
    if setup.chunk_budget_bytes is None or not setup.chunk_min_tokens:  # switched on, or no budget to weigh
        return True
    free = setup.chunk_budget_bytes - resident_weight_bytes(shape, setup) - adapter_bytes(shape, setup)
    return row_working_bytes(shape, setup.tokens) > CHUNK_FREE_SHARE * free


def resident_weight_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The base weights on the device: all of them but an input embedding table kept in host memory."""
    return weight_bytes(shape, setup) - (host_embedding_bytes(shape, setup) if setup.host_embedding else 0)


def _attention_backward_bytes(shape: ModelShape, setup: TrainSetup, backend: str) -> int:
    """Per token: what the flash kernels' backward allocates beyond the hidden-size gradients: a float32 query
    gradient accumulator, and for grouped K/V their gradients for every query head before they are summed."""
    if backend not in ("varlen", "flash_attn"):
        return 0
    return 4 * shape.q_dim + 2 * setup.activation_bytes * (shape.q_dim - shape.kv_dim)


def attention_phase_bytes(shape: ModelShape, setup: TrainSetup, backend: str) -> int:
    """Per token: what a compiled layer holds while its attention block runs backward, after its MLP's backward
    has freed the MLP's saved tensors: the attention block's saved tensors (the norm's output, q, k, v, the output
    and its log-sum-exp) and the attention kernel's backward buffers.

    A one-document row takes SDPA's causal path (cuDNN on Hopper), whose backward holds two float32 buffers the
    size of the queries, the 16-bit query, key and value gradients and a float32 value per head; measured on the
    H200 at 16,384-49,152 tokens of Llama-3.1-8B (benchmarks/qlora_memory_peak_h200.md) to the byte. A packed row
    takes the varlen kernel, whose buffers (:func:`_attention_backward_bytes`) are smaller; the larger is counted.
    """
    act = setup.activation_bytes
    saved = act * shape.hidden_size + _attention_bytes(shape, setup, backend)
    causal = 8 * shape.q_dim + act * (shape.q_dim + 2 * shape.kv_dim) + 4 * shape.num_heads
    return saved + max(causal, _attention_backward_bytes(shape, setup, backend))


def chunk_split(shape: ModelShape, setup: TrainSetup) -> tuple[int, int]:
    """Per token: (bytes of :func:`layer_activation_bytes` that chunking keeps to one chunk, bytes it adds to the
    whole row).

    A chunked module keeps only its input, so what it computes inside (the MLP's gate, up and activation outputs,
    the LoRA down-projection's input, the adapters' rank-r outputs, a float32 LoRA path's input copies and, when
    the norms are chunked, their float32 input copies) exists for one chunk at a time. Its input and output stay
    whole: the norms' inputs (the residual stream before and after attention) become kept tensors of their own, as
    do the module inputs that a float32 LoRA path did not share.
    """
    act, h = setup.activation_bytes, shape.hidden_size
    adapted = {name: fan_in for name, fan_in, _ in _adapted(shape, setup.lora_targets)}
    mlp_names = {"gate_proj", "up_proj", "down_proj"}
    scope = set(adapted) if setup.chunk_scope == "all" else mlp_names & set(adapted)
    lora_hidden = _lora_compute_bytes(setup) * setup.lora_rank * len(scope)
    fp32_copies = act != LORA_PARAM_BYTES and not setup.lora_16bit
    if fp32_copies:
        lora_inputs = LORA_PARAM_BYTES * sum(fan_in for name, fan_in in adapted.items() if name in scope)
        whole = act * h * (2 if setup.chunk_scope == "all" else 1)  # the inputs the float32 copies were made of
    else:
        lora_inputs = act * shape.intermediate_size if "down_proj" in adapted else 0
        whole = 0
    norms = 2 * (4 * h + 4) if setup.chunk_scope == "all" else 0
    if setup.chunk_scope == "all":
        whole += 2 * act * h  # the chunked norms' inputs, the residual stream before and after attention
    return _mlp_bytes(shape, setup) + lora_inputs + lora_hidden + norms, whole


def _mask_bytes(shape: ModelShape, setup: TrainSetup, backend: str) -> tuple[int, int]:
    """(kept for the whole step, kept per layer without checkpointing) by dense attention masks."""
    t = setup.tokens
    if shape.needs_explicit_masks:
        return 2 * setup.activation_bytes * t * t, 0
    if backend != "sdpa":
        return 0, 0
    padded = -(-t // 16) * 16
    # one boolean mask per batch; SDPA's memory-efficient kernel converts it to an additive bias per call and
    # saves that bias for backward
    return t * t, setup.activation_bytes * t * padded


def keeps_layer(index: int, share: float) -> bool:
    """Whether layer ``index`` (from the bottom) is one of the ``share`` of layers that keep what they save (resident
    layers): spread evenly, so they alternate with layers that only keep their input. The top layer
    is always one of them."""
    return int((index + 1) * share + 1e-9) > int(index * share + 1e-9)


def resident_layers_on_top(resident: int, total: int) -> int:
    """How many of ``resident`` evenly spread layers (:func:`keeps_layer`) sit above the top layer that recomputes:
    backward has freed what they kept by the time that layer recomputes."""
    share = min(resident, total) / max(total, 1)
    on_top = 0
    while on_top < total and keeps_layer(total - 1 - on_top, share):
        on_top += 1
    return on_top


def estimate_memory(
    shape: ModelShape, setup: TrainSetup, compute_capability: tuple[int, int] | None = (9, 0)
) -> MemoryEstimate:
    """Predict the peak allocator memory of a training step of ``setup.tokens`` tokens."""
    t, h, act = setup.tokens, shape.hidden_size, setup.activation_bytes
    backend = effective_attention(setup, compute_capability)
    per_layer = layer_activation_bytes(shape, setup, backend) * t
    step_masks, layer_mask = _mask_bytes(shape, setup, backend)
    first_norm = (4 * h + 4) * t  # the first layer's norm input comes from the frozen embedding: nothing saved
    layer_input = act * h * t
    resident = min(setup.resident_layers, shape.num_layers) if setup.checkpointing != "none" else 0
    kept_inputs = {
        "none": 0,
        "standard": (shape.num_layers - resident) * layer_input,
        "offloaded": (
            min(shape.num_layers, OFFLOAD_RING) * layer_input
            if layer_input >= MIN_OFFLOAD_BYTES
            else shape.num_layers * layer_input
        ),
    }[setup.checkpointing]
    copies = lora_weight_copy_bytes(shape, setup)
    width_grads, hidden_grads = _layer_backward_bytes(shape, setup)
    if setup.checkpointing == "none":
        activations = shape.num_layers * (per_layer + layer_mask + copies) - first_norm
        activations += dequantized_experts_bytes(shape, setup)  # the running layer's, on top of all saved
        activations += experts_rerun_bytes(shape, setup) * t
        recompute = 0
    else:
        kept_layer = resident_layer_bytes(shape, setup, backend) * t + layer_mask + copies
        activations = kept_inputs + resident * kept_layer
        chunk = setup.chunk_tokens if _chunks(shape, setup) and setup.chunk_tokens else t
        layer = per_layer
        if chunk < t:
            local, whole = chunk_split(shape, setup)
            if setup.chunk_scope == "all":
                whole -= act * h  # the layer's input, which the chunked first norm keeps: counted in kept_inputs
            layer += (whole - local) * t + local * chunk
        # the MLP's gradients and the attention kernel's backward buffers are alive one after the other
        working = layer + max(width_grads * chunk, _attention_backward_bytes(shape, setup, backend) * t)
        if setup.chunk_scope == "mlp":  # compiled layers: see attention_phase_bytes
            working = max(layer + width_grads * chunk, attention_phase_bytes(shape, setup, backend) * t)
        # the top recomputing layer runs after backward has freed the resident layers above it; the top resident
        # layer's own backward, before that, holds every resident layer's tensors and its gradients
        freed = resident_layers_on_top(resident, shape.num_layers) * kept_layer
        gradients = width_grads + hidden_grads
        top_resident = activations + resident_backward_bytes(shape, setup, gradients) if resident else 0
        recompute = activations - freed + working + layer_mask + copies + hidden_grads * t
        recompute += dequantized_layer_bytes(shape, setup) + dequantized_experts_bytes(shape, setup)
        recompute += experts_rerun_bytes(shape, setup) * t
        recompute = max(recompute, top_resident)
    final_norm = (4 * h + 4) * t
    loss = final_norm + loss_bytes(shape, setup)
    return MemoryEstimate(
        weights=resident_weight_bytes(shape, setup),
        adapter=adapter_bytes(shape, setup),
        activations=activations,
        loss=loss,
        recompute=recompute,
        attention_masks=step_masks,
        overhead=FIXED_OVERHEAD_BYTES,
        attention=backend,
        parts={"per_layer_activations": per_layer, "checkpointed_inputs": kept_inputs},
    )


def resident_backward_bytes(shape: ModelShape, setup: TrainSetup, gradients_per_token: int) -> int:
    """What the top resident layer's backward holds beyond the tensors it kept: its gradients, the MLP activation a
    compiled layer recomputes there, and its 4-bit weights decoded to 16 bits for their input gradients (up to one
    layer's; an MoE layer's experts as :func:`dequantized_experts_bytes`). Measured on the H200 (Llama-3.1-8B QLoRA,
    4,096 tokens, 6-12 resident layers with the top one recomputing: 0.94-1.02 GiB above the kept tensors; this
    gives 0.94). MoE layers with resident layers have not been measured."""
    t = setup.tokens
    if shape.is_moe:
        return gradients_per_token * t + dequantized_experts_bytes(shape, setup)
    recomputed = setup.activation_bytes * shape.intermediate_size * t if setup.chunk_scope == "mlp" else 0
    decoded = _sixteen_bit_layer_bytes(shape, setup.activation_bytes) if setup.qlora else 0
    return gradients_per_token * t + recomputed + decoded


def _sixteen_bit_layer_bytes(shape: ModelShape, act: int) -> int:
    """One dense decoder layer's projection weights in 16 bits."""
    h = shape.hidden_size
    return act * (2 * h * shape.q_dim + 2 * h * shape.kv_dim + 3 * h * shape.intermediate_size)


def dequantized_layer_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The 16-bit copies dequantize-once keeps during one layer's recompute and backward (dense layers' q, k, v,
    o, gate and up projections; nothing without QLoRA or under standard checkpointing, which never uses them), and
    the down projection's, which its backward dequantizes while they are kept (the recompute never needed it: 416
    MiB of 16-bit Llama-3.1-8B weights alive at a 4,096-token row's peak on the H200, 7 tensors)."""
    if not (setup.qlora and setup.dequant_once and setup.checkpointing == "offloaded") or shape.is_moe:
        return 0
    return _sixteen_bit_layer_bytes(shape, 2)


def loss_bytes(shape: ModelShape, setup: TrainSetup) -> int:
    """The loss's working set: stock's full fp32 logits, or the fused loss's hidden-state gradient and one chunk
    (fp32 logits within FUSED_CHUNK_LOGIT_BYTES, reused for their gradient, plus 16-bit logits and gradient)."""
    t, vocab = setup.tokens, shape.vocab_size
    if not setup.fused_loss:
        return CROSS_ENTROPY_BYTES_PER_LOGIT * vocab * t
    chunk = min(t, max(16, FUSED_CHUNK_LOGIT_BYTES // (4 * vocab) // 16 * 16))
    return setup.activation_bytes * shape.hidden_size * t + chunk * vocab * (4 + 2 + 2)


def usable_bytes(vram_bytes: int, *, integrated: bool = False, other_used_bytes: int = 0) -> int:
    """What a training process can allocate on a card: less the CUDA context and memory others already use.

    Integrated (unified-memory) GPUs share their memory with the operating system, so a quarter is left to it.
    """
    usable = int(vram_bytes * 0.75) if integrated else vram_bytes
    return max(0, usable - CONTEXT_BYTES - other_used_bytes)


def fits(estimate: MemoryEstimate, budget_bytes: int, margin: float = SAFETY_MARGIN) -> bool:
    return estimate.peak * (1 + margin) <= budget_bytes


def largest_tokens(
    shape: ModelShape,
    setup: TrainSetup,
    budget_bytes: int,
    *,
    min_tokens: int = 256,
    max_tokens: int = 16384,
    step: int = 256,
    compute_capability: tuple[int, int] | None = (9, 0),
    margin: float = SAFETY_MARGIN,
) -> int | None:
    """The largest multiple of ``step`` in [min_tokens, max_tokens] whose step fits ``budget_bytes`` (None: none).

    Memory grows monotonically with tokens, so this is a binary search.
    """
    low = -(-min_tokens // step)
    high = max_tokens // step
    if high < low:
        return None

    def ok(units: int) -> bool:
        estimate = estimate_memory(shape, setup.with_tokens(units * step), compute_capability)
        return fits(estimate, budget_bytes, margin)

    units = _largest_passing(low, high, ok)
    return None if units is None else units * step


def _largest_passing(low: int, high: int, ok: Callable[[int], bool]) -> int | None:
    """The largest n in [low, high] with ``ok(n)``, for ``ok`` true up to some n and false after (None: not even
    ``low``): a binary search."""
    if not ok(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def most_resident_layers(
    shape: ModelShape,
    setup: TrainSetup,
    budget_bytes: int,
    compute_capability: tuple[int, int] | None = (9, 0),
    margin: float = SAFETY_MARGIN,
) -> int:
    """The most layers that keep their activations and skip the recompute (engine.speed.resident_layers) on top of
    ``setup``'s checkpointed step within ``budget_bytes``: 0 without checkpointing, where the row's MLPs run in
    chunks (memory is short there, and the engine keeps every layer checkpointed) or with no memory to spare.
    Layers that leave the checkpointed step's peak where it was are kept even where that peak is already within the
    margin: the top layer, whose tensors backward has freed before the layer below it recomputes."""
    if setup.checkpointing == "none" or _chunks(shape, setup):
        return 0
    checkpointed = estimate_memory(shape, replace(setup, resident_layers=0), compute_capability).peak

    def ok(count: int) -> bool:
        estimate = estimate_memory(shape, replace(setup, resident_layers=count), compute_capability)
        return fits(estimate, budget_bytes, margin) or estimate.peak <= checkpointed

    return _largest_passing(1, shape.num_layers, ok) or 0


def training_flops_per_token(shape: ModelShape, setup: TrainSetup, mean_document_tokens: int = 1024) -> float:
    """Matmul FLOPs per trained token: forward 2N, backward 2N (input gradients only: the base is frozen),
    one more forward when checkpointing recomputes (in the layers that are not resident); causal attention over the
    average document length."""
    recomputed = 1 - min(setup.resident_layers, shape.num_layers) / max(shape.num_layers, 1)
    passes = 2 + recomputed if setup.checkpointing != "none" else 2
    dense = 2 * shape.active_params_per_token() * passes
    context = min(setup.tokens, mean_document_tokens) / 2
    attention = 4 * shape.num_layers * shape.q_dim * context * (passes + 0.5)
    return dense + attention


@dataclass(frozen=True)
class MemoryPlan:
    """Memory settings chosen for one model on one memory budget, each with a reason a user can read."""

    budget_bytes: int
    qlora: bool
    checkpointing: Checkpointing
    tokens: int | None
    """Tokens per batch; None when not even ``min_tokens`` fit."""
    estimate: MemoryEstimate
    reasons: dict[str, str]
    largest_possible_tokens: int | None = None
    """When nothing fits at ``min_tokens``: the largest row that would fit at all (to suggest a shorter max_seq_len)."""
    longest_tokens: int | None = None
    """The longest row that trains on this budget with the plan's LoRA or QLoRA and the checkpointing that saves
    the most memory (up to LONGEST_ROW_TOKENS, in steps of 256)."""
    resident_layers: int = 0
    """Layers that can keep their activations in the memory the checkpointed batch leaves
    (engine.speed.resident_layers); the estimate is the batch's need without them, they only use what is left."""

    @property
    def fits(self) -> bool:
        return self.tokens is not None


LONGEST_ROW_TOKENS = 262_144
"""How far :func:`longest_row` looks."""


def longest_row(
    shape: ModelShape,
    setup: TrainSetup,
    budget_bytes: int,
    *,
    can_offload: bool,
    compute_capability: tuple[int, int] | None,
    margin: float = SAFETY_MARGIN,
) -> int | None:
    """The longest row ``setup`` trains on ``budget_bytes`` with the checkpointing that saves the most memory
    (None: not even 256 tokens)."""
    mode = checkpoint_choice.leanest_mode(can_offload)
    return largest_tokens(
        shape, replace(setup, checkpointing=mode), budget_bytes, min_tokens=256, max_tokens=LONGEST_ROW_TOKENS,
        compute_capability=compute_capability, margin=margin,
    )  # fmt: skip


def _longest_reason(shape: ModelShape, setup: TrainSetup, tokens: int, can_offload: bool) -> str:
    mode = checkpoint_choice.leanest_mode(can_offload)
    how = f"{'QLoRA' if setup.qlora else 'LoRA'} and {mode} checkpointing"
    if _chunks(shape, replace(setup, tokens=tokens, checkpointing=mode)):
        how += f", the MLPs in chunks of {setup.chunk_tokens:,} tokens"
    return f"{tokens:,} tokens, with {how}"


def _mode_order(checkpointing: str | None, can_offload: bool) -> tuple[Checkpointing, ...]:
    if checkpointing is not None:
        return (checkpointing,)  # type: ignore[return-value]
    return checkpoint_choice.candidate_modes(can_offload)


def _best_mode(
    found: dict[Checkpointing, int], preferred_tokens: int, checkpointing: Checkpointing | None, on_gpu: bool
) -> tuple[Checkpointing, int] | None:
    """The requested mode where it fits; else the one checkpointing decision (engine.hardware.checkpoint_choice) over
    the rows each mode fits."""
    if not found:
        return None
    if checkpointing is not None:
        return checkpointing, found[checkpointing]
    facts = checkpoint_choice.CheckpointFacts(on_gpu, fits=tuple(found.items()), wanted_tokens=preferred_tokens)
    mode = checkpoint_choice.decide_checkpointing(facts).mode
    return mode, found[mode]


def choose_memory_settings(
    shape: ModelShape,
    budget_bytes: int,
    *,
    base: TrainSetup | None = None,
    compute_capability: tuple[int, int] | None = (9, 0),
    can_offload: bool = True,
    qlora: bool | None = None,
    checkpointing: Checkpointing | None = None,
    min_tokens: int = 2048,
    preferred_tokens: int = 8192,
    max_tokens: int = 16384,
    margin: float = SAFETY_MARGIN,
) -> MemoryPlan:
    """LoRA vs QLoRA, checkpointing mode and tokens per batch for ``budget_bytes`` (None arguments: choose).

    LoRA is preferred when it fits at ``min_tokens``; no checkpointing is preferred when it still fits
    ``preferred_tokens`` (recompute costs ~30% of step time); otherwise the mode that fits the largest batch.
    """
    base = base or TrainSetup()
    if base.chunk_min_tokens and base.chunk_budget_bytes is None:  # automatic chunking weighs this budget
        base = replace(base, chunk_budget_bytes=budget_bytes)
    max_tokens = max(max_tokens, min_tokens)
    options = [qlora] if qlora is not None else [False, True]
    for quantized in options:
        found: dict[Checkpointing, int] = {}
        for mode in _mode_order(checkpointing, can_offload):
            setup = replace(base, qlora=quantized, checkpointing=mode)
            tokens = largest_tokens(
                shape, setup, budget_bytes, min_tokens=min_tokens, max_tokens=max_tokens,
                compute_capability=compute_capability, margin=margin,
            )  # fmt: skip
            if tokens is not None:
                found[mode] = tokens
        chosen = _best_mode(found, preferred_tokens, checkpointing, compute_capability is not None)
        if chosen is not None:
            mode, tokens = chosen
            setup = replace(base, qlora=quantized, checkpointing=mode, tokens=tokens)
            estimate = estimate_memory(shape, setup, compute_capability)  # what the batch needs, the plan's peak
            on_gpu = compute_capability is not None  # the engine sizes resident layers from a GPU's memory only
            resident = most_resident_layers(shape, setup, budget_bytes, compute_capability, margin) if on_gpu else 0
            setup = replace(setup, resident_layers=resident)
            reasons = _plan_reasons(shape, setup, estimate, budget_bytes, found, qlora is None, options)
            reasons["memory"] = _memory_reason(shape, setup, estimate, can_offload, compute_capability)
            if resident:
                reasons["resident_layers"] = _resident_reason(
                    shape, setup, estimate_memory(shape, setup, compute_capability)
                )
            longest = longest_row(  # resident layers only spend what a row leaves: a longer row keeps none
                shape, replace(setup, resident_layers=0), budget_bytes, can_offload=can_offload,
                compute_capability=compute_capability, margin=margin,
            )  # fmt: skip
            if longest is not None:
                reasons["longest"] = _longest_reason(shape, setup, longest, can_offload)
            plan = MemoryPlan(budget_bytes, quantized, mode, tokens, estimate, reasons, longest_tokens=longest)
            return replace(plan, resident_layers=resident)
    return _no_fit_plan(
        shape, base, budget_bytes, options[-1], checkpointing, can_offload, compute_capability, margin, min_tokens
    )


def _no_fit_plan(
    shape: ModelShape,
    base: TrainSetup,
    budget_bytes: int,
    quantized: bool,
    checkpointing: Checkpointing | None,
    can_offload: bool,
    compute_capability: tuple[int, int] | None,
    margin: float,
    wanted_tokens: int,
) -> MemoryPlan:
    """No setting fits ``wanted_tokens``: the longest row that would, for the message."""
    mode = checkpointing or checkpoint_choice.leanest_mode(can_offload)
    setup = replace(base, qlora=quantized, checkpointing=mode)
    possible = largest_tokens(
        shape, setup, budget_bytes, min_tokens=256, max_tokens=max(256, wanted_tokens),
        compute_capability=compute_capability, margin=margin,
    )  # fmt: skip
    estimate = estimate_memory(shape, setup.with_tokens(max(256, wanted_tokens)), compute_capability)
    need = estimate_memory(shape, setup.with_tokens(256), compute_capability).peak * (1 + margin)
    why = (
        f"does not fit: even 256 tokens need ~{need / GIB:.1f} GiB, {budget_bytes / GIB:.1f} GiB usable"
        if possible is None
        else f"only rows of up to {possible:,} tokens fit: lower max_seq_len to {possible:,} or use a bigger GPU"
    )
    return MemoryPlan(budget_bytes, quantized, mode, None, estimate, {"fit": why}, largest_possible_tokens=possible)


def _plan_reasons(
    shape: ModelShape,
    setup: TrainSetup,
    estimate: MemoryEstimate,
    budget_bytes: int,
    found: dict[Checkpointing, int],
    chose_qlora: bool,
    options: list[bool],
) -> dict[str, str]:
    usable = budget_bytes / GIB
    name = shape.display_name()
    bf16_weights = weight_bytes(shape, replace(setup, qlora=False)) / GIB
    if not chose_qlora:
        qlora = "QLoRA requested" if setup.qlora else "LoRA requested"
    elif setup.qlora:
        qlora = (
            f"QLoRA: {name} in 16-bit needs ~{bf16_weights:.1f} GiB of weights plus activations, "
            f"{usable:.1f} GiB usable"
        )
    else:
        qlora = f"LoRA in 16-bit: {name} needs ~{bf16_weights:.1f} GiB of weights and fits; QLoRA would be slower"
    mode = setup.checkpointing
    if mode == "none":
        ckpt = f"checkpointing off: activations for {setup.tokens:,} tokens fit, no recompute needed"
    else:
        plain = found.get("none")
        limit = f"without it only {plain:,} tokens fit" if plain else "without it not even the minimum batch fits"
        where = "layer inputs offloaded to host memory" if mode == "offloaded" else "layers recomputed in backward"
        ckpt = f"checkpointing {mode} ({where}): {limit}"
    tokens = (
        f"{setup.tokens:,} tokens per batch: predicted peak {estimate.gib():.1f} GiB of {usable:.1f} GiB usable "
        f"({SAFETY_MARGIN:.0%} margin kept)"
    )
    if setup.checkpointing != "none" and _chunks(shape, setup):
        tokens += f", with the MLPs in chunks of {setup.chunk_tokens:,} tokens"
    return {"qlora": qlora, "checkpointing": ckpt, "tokens_per_batch": tokens}


def _memory_reason(
    shape: ModelShape,
    setup: TrainSetup,
    estimate: MemoryEstimate,
    can_offload: bool,
    compute_capability: tuple[int, int] | None,
) -> str:
    """What fills the plan's peak, and why a smaller model may plan more: without checkpointing every layer keeps
    its activations (the fastest way, taken while the row fits), so a model that fits that way can use more memory
    than a larger one that must recompute."""
    mode = "no recompute" if setup.checkpointing == "none" else f"{setup.checkpointing} checkpointing"
    text = f"{estimate.gib():.1f} GiB for {setup.tokens:,}-token rows with {mode}: {estimate.breakdown_text()}"
    if setup.checkpointing != "none":
        return text
    leanest = checkpoint_choice.leanest_mode(can_offload)
    lean = estimate_memory(shape, replace(setup, checkpointing=leanest), compute_capability)
    return (
        f"{text}. Every layer keeps its activations for backward, the fastest way while they fit; with {leanest} "
        f"checkpointing the same rows would need ~{lean.gib():.1f} GiB"
    )


def _resident_reason(shape: ModelShape, setup: TrainSetup, with_them: MemoryEstimate) -> str:
    return (
        f"{setup.resident_layers} of {shape.num_layers} layers keep their activations in the memory left and skip "
        f"the recompute (up to ~{with_them.gib():.1f} GiB in all)"
    )
