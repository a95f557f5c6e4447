"""The speed optimizations behind one controller whose switches can flip between two training steps.

Each optimization lives in its own module with a pure core, a fallback and a docstring that says why:
:mod:`engine.speed.metadata_cache` (packed-sequence metadata built once per batch, zero syncs),
:mod:`engine.speed.offloaded_checkpoint` (checkpointed layer inputs in host memory, look-ahead prefetch),
:mod:`engine.speed.resident_layers` (the layers spare GPU memory holds skip the recompute),
:mod:`engine.speed.moe_routing` (experts on sorted token slices), :mod:`engine.speed.fused_loss` (the loss
and its gradient from the hidden states in chunks, never the full logits), :mod:`engine.speed.lora_16bit` (LoRA
adapters computed in the model's 16-bit dtype, sharing one A product per group of projections reading the same input
through :mod:`engine.speed.lora_groups`), :mod:`engine.speed.lean_recompute` (frozen projections an offloaded
recompute skips, 4-bit weights dequantized once, fp8 products) and :mod:`engine.speed.fused_kernels` (each layer's
small per-token operations fused by a regional torch.compile). They plug into transformers through
its registries (attention functions, experts implementations, the gradient-checkpointing function), so switching is
a change of registered name or checkpoint function: no model reload, no reassigned library method. The fused
loss is the training loop's call to :meth:`SpeedController.loss` instead of the model's own forward, and
:mod:`engine.speed.step_graphs` replays each micro-batch's forward and backward from a CUDA graph through
:meth:`SpeedController.forward_backward`. The resolved choices are one frozen :class:`engine.speed.plan.SpeedPlan`
(``SpeedController.plan``; :meth:`SpeedController.state` is its JSON form), and checkpointing is decided by
:func:`engine.hardware.checkpoint_choice.decide_checkpointing`, the function the planner and ``tunedeck plan`` call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import torch

from engine.config import SpeedConfig
from engine.data.model_inputs import stock_model_inputs
from engine.data.packing import PackedBatch
from engine.hardware import checkpoint_choice
from engine.hardware.checkpoint_choice import Checkpointing, CheckpointPlan, Requested
from engine.hardware.shapes import ModelShape
from engine.speed import (
    chunked_mlp,
    fp8_base,
    fused_kernels,
    fused_loss,
    lean_recompute,
    lora_16bit,
    metadata_cache,
    moe_routing,
    offloaded_checkpoint,
    resident_layers,
    reuse,
    step_graphs,
    warm_up,
)
from engine.speed.fused_kernels import transformers_model
from engine.speed.host_embedding import HostEmbedding
from engine.speed.lora_16bit import Lora16Bit, adapted_layers
from engine.speed.lora_groups import LoraGroups
from engine.speed.offloaded_checkpoint import ActivationOffloader
from engine.speed.plan import Choice, Fp8Choice, LoraChoice, MetadataChoice, ModeChoice, ResidentChoice, SpeedPlan

__all__ = [
    "GRAPHS_SHORT_OF_MEMORY",
    "RESIDENT_SHORT_OF_MEMORY",
    "SpeedController",
    "free_device_memory",
    "transformers_model",
]

GRAPHS_SHORT_OF_MEMORY = (
    "GPU memory ran short beside the step graphs' memory pool; micro-batches run eagerly until memory has room again"
)
RESIDENT_SHORT_OF_MEMORY = "GPU memory ran short with layers resident; every layer checkpoints until memory has room"
ACTIVATION_BYTES_PER_TOKEN_AND_HIDDEN = 34
"""Bytes kept per token × hidden per layer without checkpointing in 16-bit (Korthikanti et al., flash attention)."""


def free_device_memory(device: torch.device) -> int:
    """Free GPU memory as this process may use it: the driver's free bytes, lowered to what is left under an
    allocator cap (``torch.cuda.set_per_process_memory_fraction``, how a smaller card is emulated)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = _memory_fraction(device)
    if fraction < 1.0:
        # under the cap, blocks the allocator caches but no tensor holds are free to reuse
        free = min(free, int(fraction * total) - torch.cuda.memory_allocated(device))
    return max(0, free)


def usable_device_memory(device: torch.device) -> int:
    """The GPU memory this process may use in all: the card's, or the allocator cap's where one is set."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(min(1.0, _memory_fraction(device)) * total)


def reachable_device_memory(device: torch.device) -> int:
    """All the GPU memory this process could hold now: what it holds (its allocator's cache included) and what the
    driver has free, within an allocator cap."""
    free, _ = torch.cuda.mem_get_info(device)
    return min(usable_device_memory(device), free + torch.cuda.memory_reserved(device))


def _memory_fraction(device: torch.device) -> float:
    """The allocator cap as a share of the card (1.0 without one, or on a torch that cannot tell)."""
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is None:
        return 1.0
    return float(get_fraction(device.index if device.index is not None else torch.cuda.current_device()))


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point() and param.element_size() >= 2:
            return param.dtype
    return torch.float32


class SpeedController:
    """Resolves the speed settings for one model and device and applies them between steps."""

    def __init__(self, model: torch.nn.Module, settings: SpeedConfig, device: torch.device) -> None:
        self.model = model
        self.device = torch.device(device)
        self.hf_model = transformers_model(model)
        self.dtype = _model_dtype(self.hf_model)
        # What transformers would run without us (a controller left behind by an earlier run may have set ours).
        attention = self.hf_model.config._attn_implementation
        self.stock_attention: str = "sdpa" if attention == metadata_cache.ATTENTION_NAME else attention
        experts = getattr(self.hf_model.config, "_experts_implementation", None)
        ours = set(moe_routing.IMPLEMENTATION_NAMES.values())
        self.stock_experts: str | None = "grouped_mm" if experts in ours else experts
        self.offloader = ActivationOffloader(
            self.device,
            min_offload_bytes=0 if self.device.type == "cpu" else offloaded_checkpoint.MIN_OFFLOAD_BYTES,
        )
        self.settings = settings
        self.plan = SpeedPlan()
        """Every setting's resolved choice; :meth:`state` is its JSON form."""
        self._checkpointing: str | None = None
        self._metadata_backend: str | None = None
        self._cudnn = False
        self._whole_row = False
        self._fused_loss = False
        self._fused_kernels = False
        self.region_compiler = fused_kernels.RegionCompiler()
        self._auto_checkpointing_tokens = 0
        self.chunked = chunked_mlp.ChunkedModules(self.hf_model, flag=self.offloader.recompute)
        self._longest_tokens = 0
        self.host_embedding = HostEmbedding(self.hf_model, self.device)
        self.lora_16bit = Lora16Bit(model)
        self.lora_groups = LoraGroups()
        self.lean = lean_recompute.LeanRecompute(self.hf_model, self.offloader.recompute)
        self.graphs = step_graphs.StepGraphs(self.device, self._trainable, reset=self.offloader.forget_events)
        self._graphs_refused: str | None = None
        self._fused_loss_refused: str | None = None
        self.residency = resident_layers.LayerResidency()
        self.resident_override: int | None = None
        """A fixed number of resident layers where the switch is on (tests, benches); None: what the planner fits."""
        self._resident_refused: str | None = None
        self.warm_up = warm_up.WarmUpLedger()
        """The run's length and earlier runs' measurements: switches with a one-off cost decide with them."""
        metadata_cache.register_packed_attention()
        moe_routing.register_experts_implementations()
        self.apply(settings)

    # --- switches -------------------------------------------------------------------------------------------

    def apply(self, settings: SpeedConfig) -> None:
        """Apply new settings; safe between any two steps (nothing is reloaded)."""
        self.settings = dataclasses.replace(settings)
        self.dtype = _model_dtype(self.hf_model)  # the kernels' choices follow a model cast between steps
        self.graphs.clear()  # first: their memory pool goes back before any switch needs memory
        self._apply_metadata_cache(settings)
        self._apply_cudnn_attention(settings)
        self._apply_moe_routing(settings)
        self._apply_fused_loss(settings)
        self._apply_checkpointing(settings.checkpointing, reason=None)
        self._apply_chunked_mlp(settings)
        self._apply_host_embedding(settings)
        self._apply_lora_16bit(settings)
        self._apply_lean_recompute(settings)
        self._apply_fused_kernels(settings)
        self._apply_resident_layers(settings)
        self._apply_step_graphs(settings)

    def _choose(self, **choices: Any) -> None:
        """Record resolved choices: the plan is replaced, never changed in place."""
        self.plan = dataclasses.replace(self.plan, **choices)

    def expect(self, length: warm_up.RunLength, store: reuse.DecisionStore | None = None) -> None:
        """What is left of the run (and what earlier runs left in ``store``): fused kernels and step graphs,
        where automatic, are decided again and stay on only where their one-off cost pays back
        (:mod:`engine.speed.warm_up`)."""
        self.warm_up = warm_up.WarmUpLedger.for_run(self.model, self.hf_model, self.dtype, self.device, length, store)
        self.apply(self.settings)

    def _apply_metadata_cache(self, settings: SpeedConfig) -> None:
        problem = metadata_cache.unsupported_reason(self.hf_model)
        choice = metadata_cache.choose_backend(settings.attention_backend, self.device, self.dtype)
        if settings.metadata_cache is False:
            on, reason = False, "switched off: transformers' own packed path"
        elif problem is not None:
            on, reason = False, problem
        else:
            on, reason = True, choice.reason if settings.metadata_cache is None else f"switched on; {choice.reason}"
        self._metadata_backend = choice.name if on else None
        self.hf_model.set_attn_implementation(metadata_cache.ATTENTION_NAME if on else self.stock_attention)
        self._choose(metadata_cache=MetadataChoice(on, self._metadata_backend, reason))

    def _apply_cudnn_attention(self, settings: SpeedConfig) -> None:
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        if self._metadata_backend is None:
            problem: str | None = "needs the metadata cache (one-document rows are found there)"
        else:
            head_dim = ModelShape.from_config(self.hf_model.config).head_dim
            has_cudnn = torch.backends.cudnn.is_available()
            problem = metadata_cache.cudnn_problem(self.device.type, self.dtype, capability, head_dim, has_cudnn)
        backend = settings.attention_backend
        on, reason = metadata_cache.resolve_cudnn(backend, problem, capability)
        self._cudnn = on
        # a one-document row skips the document mask: for cuDNN, or automatically for the kernel SDPA picks
        self._whole_row = backend in ("auto", "cudnn")
        self._choose(cudnn_attention=Choice(on, reason))

    def _apply_moe_routing(self, settings: SpeedConfig) -> None:
        mode, reason = moe_routing.resolve_mode(settings.moe_routing, self.hf_model, self.device, self.dtype)
        if moe_routing.has_routable_experts(self.hf_model):
            name = moe_routing.IMPLEMENTATION_NAMES.get(mode, self.stock_experts or "eager")
            self.hf_model.set_experts_implementation(name)
        if mode == "stock" and settings.moe_routing == "stock":
            reason = f"switched off: transformers' {self.stock_experts or 'default'} experts implementation"
        self._choose(moe_routing=ModeChoice(mode, reason))

    def _apply_fused_loss(self, settings: SpeedConfig) -> None:
        problem = fused_loss.unsupported_reason(self.hf_model)
        if self._fused_loss_refused is not None:
            on, reason = False, f"off: {self._fused_loss_refused}"
        elif settings.fused_loss is False:
            on, reason = False, "switched off: the model's own head and transformers' loss"
        elif problem is not None:
            on, reason = False, problem
        elif settings.fused_loss is None:
            # No host sync: the packer lists the trained positions (PackedBatch.loss_positions).
            on, reason = True, "automatic: loss and gradient from the hidden states in chunks, no full logits"
        else:
            on, reason = True, "switched on; loss and gradient from the hidden states in chunks, no full logits"
        self._fused_loss = on
        self._choose(fused_loss=Choice(on, reason))

    def _resolve_fused_kernels(self, settings: SpeedConfig) -> tuple[bool, str]:
        """(on, reason) of the fused kernels, automatic ones counting their compile against the run's length."""
        on, reason = fused_kernels.resolve(settings.fused_kernels, self.hf_model, self.device)
        return self.warm_up.fused_kernels(settings.fused_kernels, on, reason)

    def _apply_fused_kernels(self, settings: SpeedConfig) -> None:
        on, reason = self._resolve_fused_kernels(settings)
        self.region_compiler.switch(self.hf_model, on)  # after the chunked MLP switch: it changes the regions
        self._fused_kernels = on
        self._choose(fused_kernels=Choice(on, reason))

    def _apply_chunked_mlp(self, settings: SpeedConfig) -> None:
        mode = self._checkpointing or "none"
        working = chunked_mlp.row_working_bytes(self.hf_model.config, self._longest_tokens)
        free = free_device_memory(self.device) if self.device.type == "cuda" else None
        on, reason = chunked_mlp.resolve(
            settings.chunked_mlp, mode, self._longest_tokens, working_bytes=working, free_bytes=free
        )
        if on:
            compiled, _ = self._resolve_fused_kernels(settings)
            self.chunked.install(mlp_only=compiled)
        else:
            self.chunked.remove()
        self._choose(chunked_mlp=Choice(on, reason))

    def _apply_host_embedding(self, settings: SpeedConfig) -> None:
        usable = usable_device_memory(self.device) if self.device.type == "cuda" else None
        on, reason = self.host_embedding.resolve(settings.host_embedding, usable)
        self.host_embedding.switch(on)
        self._choose(host_embedding=Choice(on, reason))

    def _apply_lora_16bit(self, settings: SpeedConfig) -> None:
        on, reason = lora_16bit.resolve(settings.lora_16bit, self.model, self.dtype)
        self.lora_16bit.switch(on)
        # the 16-bit path shares one LoRA A product per group of projections reading the same input
        groups = self.lora_groups.install(self.model, adapted_layers(self.model)) if on else 0
        if groups:
            reason += f"; one A product for each of {groups} groups of projections reading the same input"
        else:
            self.lora_groups.remove()
        self._choose(lora_16bit=LoraChoice(on, reason, groups))

    def _apply_lean_recompute(self, settings: SpeedConfig) -> None:
        mode = self._checkpointing or "none"
        skip = mode == "offloaded"  # exact: part of offloaded checkpointing's recompute
        extra = lean_recompute.layer_dequant_bytes(self.hf_model)
        free = free_device_memory(self.device) if self.device.type == "cuda" else None
        once, once_reason = lean_recompute.dequant_once_resolve(settings.dequant_once, mode, extra, free)
        frozen = sum(1 for _ in lean_recompute.frozen_projections(self.hf_model, every=True))
        experts = moe_routing.has_routable_experts(self.hf_model)
        fp8, fp8_reason = fp8_base.resolve(settings.fp8_base, self.device, frozen, mode, extra > 0, experts)
        scope = fp8_base.scope_of(settings.fp8_base)
        fp8, fp8_reason = fp8_base.scoped(fp8, fp8_reason, scope, mode)
        compiled, _ = self._resolve_fused_kernels(settings)
        self.lean.fp8_in_forward = scope != "recompute"
        self.lean.switch(skip, once, fp8, one_pass=compiled)
        if fp8:
            fp8_reason += fp8_coverage(*self.lean.fp8_projections())
        fp8_choice = Fp8Choice(fp8, scope if fp8 else None, fp8_reason)
        self._choose(dequant_once=Choice(once, once_reason), fp8_base=fp8_choice)

    def _apply_resident_layers(self, settings: SpeedConfig) -> None:
        total = len(fused_kernels.decoder_layers(self.hf_model))
        requested = settings.resident_layers
        blocker = self._resident_blocker()
        wanted = requested is not False and (self._checkpointing or "none") != "none" and blocker is None
        count, budget = self._resident_count(total) if wanted else (0, None)
        layers, reason = resident_layers.resolve(
            requested, self._checkpointing or "none", layers=count, total=total, blocker=blocker, budget_bytes=budget
        )
        self.residency.share = layers / total if total else 0.0
        self._choose(resident_layers=ResidentChoice(layers, reason))

    def _resident_blocker(self) -> str | None:
        if self._resident_refused is not None:
            return self._resident_refused
        if self._chunked:
            return "the row needs its MLPs in chunks: no spare memory"
        if self.resident_override is None and self.device.type != "cuda":
            return "the count is sized from a GPU's free memory"
        if self.resident_override is None and not self._longest_tokens:
            return "sized when the first batch arrives"
        return None

    def _resident_count(self, total: int) -> tuple[int, int | None]:
        """(layers, the memory they were sized for: None for a fixed count)."""
        if self.resident_override is not None:
            return min(self.resident_override, total), None
        budget = reachable_device_memory(self.device)
        capability = torch.cuda.get_device_capability(self.device)
        tokens, config = self._longest_tokens, self.hf_model.config
        count = resident_layers.planned_layers(self.model, config, self.plan.as_state(), tokens, budget, capability)
        return min(count, total), budget

    @property
    def resident_layers(self) -> int:
        """How many layers keep their activations and skip the recompute now."""
        return self.plan.resident_layers.layers if self.plan.resident_layers is not None else 0

    @property
    def holds_spare_memory(self) -> bool:
        """Step graphs' pool or resident layers hold memory a micro-batch that ran short can run again without."""
        return bool(self.graphs.captured or self.resident_layers)

    def give_up_memory(self) -> str | None:
        """After a micro-batch ran short: the resident layers go first (each saves about 1% of a step; the graphs they
        were captured with are dropped and captured again without them), the step graphs' pool next (15-25% of an 8B
        QLoRA step), one per call, until :meth:`restore_resident_layers` / :meth:`restore_step_graphs`. Returns what
        went (``"resident_layers"``, ``"step_graphs"``), None when neither held any (the caller lowers something
        else)."""
        if self.give_up_resident_layers(RESIDENT_SHORT_OF_MEMORY):
            return "resident_layers"
        if self.graphs.give_up(GRAPHS_SHORT_OF_MEMORY):
            return "step_graphs"
        return None

    def give_up_resident_layers(self, reason: str) -> bool:
        """Out of memory with resident layers: every layer checkpoints again until :meth:`restore_resident_layers`.
        False when none were resident (nothing to give up)."""
        if not self.resident_layers:
            return False
        self._resident_refused = reason
        self.graphs.clear()
        self._apply_resident_layers(self.settings)
        return True

    def restore_resident_layers(self) -> None:
        """Memory has room again: the resident layers are sized anew from what is free now."""
        self._resident_refused = None
        self.graphs.clear()
        self._apply_resident_layers(self.settings)

    def restore_step_graphs(self) -> None:
        """Memory has room again: step graphs given up for a shortage are captured again (a trial's verdict and a
        failed capture stay as they were)."""
        if self.graphs.failure == f"off: {GRAPHS_SHORT_OF_MEMORY}":
            self.graphs.failure = None

    def refuse_step_graphs(self, reason: str) -> None:
        """This run cannot replay its micro-batches (several GPUs, float16 loss scaling): step graphs stay off with
        ``reason``, whatever they are switched to."""
        self._graphs_refused = reason
        self._apply_step_graphs(self.settings)

    def refuse_fused_loss(self, reason: str) -> None:
        """This run's loss is not the causal-LM cross-entropy (DPO): the fused loss stays off with ``reason``."""
        self._fused_loss_refused = reason
        self._apply_fused_loss(self.settings)

    def _apply_step_graphs(self, settings: SpeedConfig) -> None:
        on, reason = step_graphs.resolve(settings.step_graphs, self.model, self.device)
        on, reason, trial = self.warm_up.step_graphs(settings.step_graphs, on, reason, compiled=self._fused_kernels)
        if self._graphs_refused is not None and (on or settings.step_graphs):
            on, reason = False, f"off: {self._graphs_refused}"
        elif on and self._graphs_memory_bound(settings):
            on, reason = False, step_graphs.MEMORY_BOUND
        self.graphs.switch(on, trial=trial)  # drops graphs captured under the previous ones
        self._choose(step_graphs=Choice(on, reason))

    @property
    def _chunked(self) -> bool:
        """The chunked MLP switch resolved on (automatic where the row needs it to fit in memory)."""
        return self.plan.is_on("chunked_mlp")

    def _graphs_memory_bound(self, settings: SpeedConfig) -> bool:
        """Automatic step graphs meet a row that needs chunked MLPs to fit: no room for a graph's memory pool."""
        return settings.step_graphs is None and self._chunked

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _apply_checkpointing(self, requested: str, reason: str | None) -> None:
        mode, why = self._resolve_checkpointing(requested)
        reason = reason or why
        if mode != self._checkpointing:
            if mode == "none":
                self.hf_model._set_gradient_checkpointing(enable=False)
            else:
                fn = self.offloader.checkpoint if mode == "offloaded" else offloaded_checkpoint.standard_checkpoint
                fn = self.residency.wrap(fn)
                self.hf_model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=fn)
            self._checkpointing = mode
        self._choose(checkpointing=CheckpointPlan(cast(Checkpointing, mode), reason))

    def _resolve_checkpointing(self, requested: str) -> tuple[str, str]:
        plan = checkpoint_choice.decide_checkpointing(self._checkpoint_facts(requested), cast(Requested, requested))
        return plan.mode, plan.reason

    def _checkpoint_facts(self, requested: str) -> checkpoint_choice.CheckpointFacts:
        """What the checkpointing decision needs; the rows that fit are measured only when it is automatic."""
        blocker = offloaded_checkpoint.offload_unsupported_reason(self.device)
        on_gpu = self.device.type == "cuda"
        if requested != "auto" or not on_gpu:
            return checkpoint_choice.CheckpointFacts(on_gpu, blocker)
        modes = checkpoint_choice.candidate_modes(can_offload=blocker is None)
        fits = tuple((mode, self._tokens_without_recompute() if mode == "none" else None) for mode in modes)
        return checkpoint_choice.CheckpointFacts(on_gpu, blocker, fits, wanted_tokens=self._auto_checkpointing_tokens)

    def _tokens_without_recompute(self) -> int | None:
        """The longest row whose activations fit in 60% of the free GPU memory without checkpointing (None: the
        model's config gives no size to count)."""
        config = self.hf_model.config.get_text_config()
        per_token = getattr(config, "hidden_size", 0) * getattr(config, "num_hidden_layers", 0)
        if not per_token:
            return None
        return int(0.6 * free_device_memory(self.device) // (per_token * ACTIVATION_BYTES_PER_TOKEN_AND_HIDDEN))

    # --- per batch ------------------------------------------------------------------------------------------

    def _rows_grew(self, tokens: int) -> None:
        """Automatic choices that depend on the longest row so far, decided again only when rows grow."""
        checkpointing = self.settings.checkpointing == "auto" and tokens > self._auto_checkpointing_tokens
        longer = tokens > self._longest_tokens
        if checkpointing:
            self._auto_checkpointing_tokens = tokens
            self._apply_checkpointing("auto", reason=None)
        if longer:
            self._longest_tokens = tokens
        if not (checkpointing or longer):
            return
        self._apply_chunked_mlp(self.settings)  # each of these depends on checkpointing and the longest row
        if checkpointing:
            self._apply_lean_recompute(self.settings)
        self._apply_fused_kernels(self.settings)  # the compiled regions depend on the chunks
        self._apply_resident_layers(self.settings)
        self.graphs.clear()
        if longer and self.graphs.on and self._graphs_memory_bound(self.settings):
            self._apply_step_graphs(self.settings)  # the row now needs chunks to fit: graphs go

    def model_inputs(self, batch: PackedBatch, *, timed: bool = True) -> dict[str, Any]:
        """Model kwargs for one micro-batch (already on the device); the stock ones when every switch is off.
        ``timed=False``: an extra forward pass of the same micro-batch (DPO's reference pass), which the warm-up
        clock does not count as a micro-batch of its own."""
        self.offloader.begin_batch()
        self.residency.begin_batch()
        if timed:
            self.warm_up.tick(self._fused_kernels, self.graphs.active, self.graphs.trial_result)
        self._rows_grew(batch.num_tokens)
        inputs = stock_model_inputs(self.model, batch)
        if self.host_embedding.on:
            self.host_embedding.stage(batch.host_input_ids)
        if self._metadata_backend is None:
            return inputs
        meta = metadata_cache.build_metadata(
            batch, self.device, self._metadata_backend, whole_row=self._whole_row, cudnn=self._cudnn
        )
        if self._fused_kernels or self.graphs.active:  # masks built here are graph inputs, not host work inside
            fused_kernels.prepare_metadata(meta, self.hf_model)
        return metadata_cache.packed_inputs(inputs, meta)

    def loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        labels: torch.Tensor,
        num_items: int | torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The micro-batch loss (sum over counted tokens / ``num_items``), fused when that switch is on.

        ``positions`` (``PackedBatch.loss_positions`` on the device) spare the fused loss its one host sync.
        """
        if self._fused_loss:
            return fused_loss.fused_causal_lm_loss(
                model, inputs, labels, num_items, positions=positions, compiled=self._fused_kernels
            )
        return cast(torch.Tensor, model(**inputs, labels=labels, num_items_in_batch=num_items).loss)

    def forward_backward(self, model: torch.nn.Module, batch: PackedBatch, num_items: int) -> torch.Tensor:
        """Forward and backward of one micro-batch (on the device) through :meth:`loss`; its detached loss.

        With step graphs on, the row is padded into its shape bucket and the work replays from a CUDA graph
        (:mod:`engine.speed.step_graphs`); a host-side embedding lookup then runs before the graph."""
        if not self.graphs.active:  # off, or turned off by a failure: no padding either
            inputs = self.model_inputs(batch)
            return self._backward(model, {"inputs": inputs, "labels": batch.labels, "num_items": num_items,
                                          "positions": batch.loss_positions})  # fmt: skip
        padded = step_graphs.pad_to(batch, self.graphs.bucket(batch))
        inputs = self.model_inputs(padded)
        if self.host_embedding.on:  # the lookup runs on the host: outside the graph, which takes its rows
            inputs["inputs_embeds"] = self.host_embedding.lookup(inputs.pop("input_ids"))
        count = torch.full((), num_items, dtype=torch.float32, device=self.device)
        tree = {"inputs": inputs, "labels": padded.labels, "num_items": count, "positions": padded.loss_positions}
        return self.graphs.run(tree, functools.partial(self._backward, model))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients after an optimizer step: in place, in one kernel, while step graphs hold them in
        fixed tensors (the next micro-step accumulates into those), else set to None, which frees their memory."""
        if self.graphs.holds_grads:
            self.graphs.zero_grads()
        else:
            optimizer.zero_grad(set_to_none=True)

    def _backward(self, model: torch.nn.Module, tree: dict[str, Any]) -> torch.Tensor:
        loss = self.loss(model, tree["inputs"], tree["labels"], tree["num_items"], positions=tree["positions"])
        loss.backward()
        return loss.detach()

    def state(self) -> dict[str, Any]:
        """Resolved choices, each with a one-line reason."""
        state = self.plan.as_state()
        if self.graphs.failure is not None and "step_graphs" in state:
            state["step_graphs"] = {"on": False, "reason": self.graphs.failure}
        elif self.graphs.verdict is not None and "step_graphs" in state:
            state["step_graphs"] = {"on": True, "reason": self.graphs.verdict}
        return state


def fp8_coverage(done: int, one_pass: int, total: int) -> str:
    """What the fp8-base reason adds: projections left in 16 bits, and the 4-bit weights cast in one pass."""
    words = ""
    if done < total:
        words += f" ({done} of {total} frozen projections; the others' widths are not multiples of 16)"
    if one_pass:
        words += f"; {one_pass} 4-bit weights go to e4m3 in one pass (fused kernels)"
    return words
