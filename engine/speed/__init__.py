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
:meth:`SpeedController.forward_backward`. Every choice is made at once by the pure
:func:`engine.speed.decide.decide_plan` from typed facts the controller reads (model, device, run so far) into one
frozen :class:`engine.speed.plan.SpeedPlan` (``SpeedController.plan``; :meth:`SpeedController.state` is its JSON
form); a live switch, a longer row or an out-of-memory step is a new decision, and the controller installs what
changed. Checkpointing inside it is :func:`engine.hardware.checkpoint_choice.decide_checkpointing`, the function the
planner and ``tunedeck plan`` call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import torch

from engine.config import SpeedConfig
from engine.data.model_inputs import stock_model_inputs
from engine.data.packing import PackedBatch
from engine.hardware.shapes import ModelShape
from engine.speed import (
    chunked_mlp,
    four_bit_weights,
    fp8_base,
    fused_kernels,
    fused_loss,
    host_embedding,
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
from engine.speed.decide import DeviceFacts, Fp8Coverage, ModelFacts, RunFacts, SpeedFacts, decide_plan
from engine.speed.fused_kernels import transformers_model
from engine.speed.host_embedding import HostEmbedding
from engine.speed.lora_16bit import Lora16Bit, adapted_layers
from engine.speed.lora_groups import LoraGroups, find_groups
from engine.speed.offloaded_checkpoint import ActivationOffloader
from engine.speed.plan import SpeedPlan

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
    """Decides the speed settings for one model and device (:func:`engine.speed.decide.decide_plan`) and installs the
    plan between steps."""

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
        """Every setting's choice, installed; :meth:`state` is its JSON form."""
        self.run = RunFacts()
        """The run so far as the decisions read it (longest row, refusals, warm-up ledger)."""
        self.region_compiler = fused_kernels.RegionCompiler()
        self.chunked = chunked_mlp.ChunkedModules(self.hf_model, flag=self.offloader.recompute)
        self.host_embedding = HostEmbedding(self.hf_model, self.device)
        self.lora_16bit = Lora16Bit(model)
        self.lora_groups = LoraGroups()
        self.lean = lean_recompute.LeanRecompute(self.hf_model, self.offloader.recompute)
        self.graphs = step_graphs.StepGraphs(self.device, self._trainable, reset=self.offloader.forget_events)
        self.residency = resident_layers.LayerResidency()
        self._model_facts = ModelFacts()
        self._device_facts = DeviceFacts()
        metadata_cache.register_packed_attention()
        moe_routing.register_experts_implementations()
        self.apply(settings)

    # --- deciding and installing ----------------------------------------------------------------------------

    def apply(self, settings: SpeedConfig) -> None:
        """Apply new settings; safe between any two steps (nothing is reloaded)."""
        self.settings = dataclasses.replace(settings)
        self.dtype = _model_dtype(self.hf_model)  # the kernels' choices follow a model cast between steps
        self.graphs.clear()  # first: their memory pool goes back before the free memory is read
        self._model_facts = self.read_model_facts()
        self._device_facts = self.read_device_facts()
        self._decide(graphs_anew=True)

    def facts(self) -> SpeedFacts:
        """What the plan in force was decided from."""
        return SpeedFacts(self._model_facts, self._device_facts, self.run)

    def _decide(self, graphs_anew: bool = False) -> None:
        """Decide from the facts as they are now and install what differs from the plan in force. ``graphs_anew``:
        step graphs start over (a new setting: the trial runs again) even where their choice is unchanged."""
        previous, self.plan = self.plan, decide_plan(self.facts(), self.settings)
        self._install(previous, self.plan, graphs_anew)

    def _install(self, previous: SpeedPlan, plan: SpeedPlan, graphs_anew: bool) -> None:
        """Make the model run ``plan``: each part is touched only where a choice it reads acts differently from
        ``previous``. The compiled regions come last: they are found over the modules the others put in place."""

        def changed(*names: str) -> bool:
            return any(_acting(getattr(previous, name)) != _acting(getattr(plan, name)) for name in names)

        if changed("checkpointing"):
            self._install_checkpointing(_mode(plan))
        if changed("metadata_cache"):
            on = plan.is_on("metadata_cache")
            self.hf_model.set_attn_implementation(metadata_cache.ATTENTION_NAME if on else self.stock_attention)
        if changed("moe_routing") and moe_routing.has_routable_experts(self.hf_model):
            mode = plan.moe_routing.mode if plan.moe_routing is not None else "stock"
            self.hf_model.set_experts_implementation(
                moe_routing.IMPLEMENTATION_NAMES.get(mode, self.stock_experts or "eager")
            )
        if changed("chunked_mlp", "fused_kernels"):
            if plan.is_on("chunked_mlp"):
                self.chunked.install(mlp_only=plan.is_on("fused_kernels"))
            else:
                self.chunked.remove()
        if changed("host_embedding"):
            self.host_embedding.switch(plan.is_on("host_embedding"))
        if changed("lora_16bit"):
            self._install_lora_16bit(plan.is_on("lora_16bit"))
        if changed("checkpointing", "dequant_once", "fp8_base", "fused_kernels"):
            self._install_lean_recompute(plan)
        if changed("fused_kernels", "chunked_mlp", "checkpointing", "lora_16bit", "dequant_once", "fp8_base"):
            # the regions are found again over the modules these put in place (compiled code is kept for reuse)
            self.region_compiler.switch(self.hf_model, plan.is_on("fused_kernels"))
        layers = plan.resident_layers.layers if plan.resident_layers is not None else 0
        self.residency.share = layers / self._model_facts.layers if self._model_facts.layers else 0.0
        if graphs_anew or changed("step_graphs"):
            graphs = plan.step_graphs
            self.graphs.switch(graphs is not None and graphs.on, trial=graphs is not None and graphs.trial)

    def _install_checkpointing(self, mode: str) -> None:
        if mode == "none":
            self.hf_model._set_gradient_checkpointing(enable=False)
            return
        fn = self.offloader.checkpoint if mode == "offloaded" else offloaded_checkpoint.standard_checkpoint
        self.hf_model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=self.residency.wrap(fn))

    def _install_lora_16bit(self, on: bool) -> None:
        self.lora_16bit.switch(on)
        if on:  # the 16-bit path shares one LoRA A product per group of projections reading the same input
            self.lora_groups.install(self.model, adapted_layers(self.model))
        else:
            self.lora_groups.remove()

    def _install_lean_recompute(self, plan: SpeedPlan) -> None:
        fp8 = plan.fp8_base
        self.lean.fp8_in_forward = fp8 is not None and fp8.scope == "all"
        skip = _mode(plan) == "offloaded"  # exact: part of offloaded checkpointing's recompute
        once, compiled = plan.is_on("dequant_once"), plan.is_on("fused_kernels")
        self.lean.switch(skip, once, plan.is_on("fp8_base"), one_pass=compiled)

    def read_model_facts(self) -> ModelFacts:
        """What the decisions read from the model, as it is now."""
        hf, device = self.hf_model, self.device
        text = hf.config.get_text_config()
        layers = len(fused_kernels.decoder_layers(hf))
        lora_problem = lora_16bit.unsupported_reason(self.model, self.dtype)
        frozen = list(lean_recompute.frozen_projections(hf, every=True))
        return ModelFacts(
            dtype=self.dtype,
            shape=_shape(hf.config),
            layers=layers,
            attention_problem=metadata_cache.unsupported_reason(hf),
            fused_loss_problem=fused_loss.unsupported_reason(hf),
            fused_kernels_problem=fused_kernels.unsupported_reason(hf),
            fused_kernels_automatic=fused_kernels.automatic(hf, device),
            lora_16bit_problem=lora_problem,
            lora_groups=self._group_count() if lora_problem is None else 0,
            graphs_problem=step_graphs.unsupported_reason(self.model, device),
            host_embedding_problem=host_embedding.unsupported_reason(hf),
            embedding_bytes=self.host_embedding.table_bytes() if device.type == "cuda" else 0,
            experts=moe_routing.has_routable_experts(hf),
            frozen_projections=len(frozen),
            dequant_bytes=lean_recompute.layer_dequant_bytes(hf),
            fp8=_fp8_coverage(frozen),
            qlora=resident_layers.is_4bit(self.model),
            lora_rank=resident_layers.lora_rank(self.model),
            activation_units=getattr(text, "hidden_size", 0) * getattr(text, "num_hidden_layers", 0),
            row_bytes_per_token=chunked_mlp.row_working_bytes(hf.config, 1),
            stock_experts=self.stock_experts,
        )

    def _group_count(self) -> int:
        """Groups of adapted projections reading the same input: those installed, or those there would be."""
        if self.lora_groups.groups:
            return len(self.lora_groups.groups)
        return len(find_groups(self.model, adapted_layers(self.model)))

    def read_device_facts(self) -> DeviceFacts:
        """The device and the GPU memory this process may use, read now."""
        device = self.device
        on_gpu = device.type == "cuda"
        capability = torch.cuda.get_device_capability(device) if on_gpu else None
        return DeviceFacts(
            kind=device.type,
            capability=capability,
            has_cudnn=torch.backends.cudnn.is_available(),
            offload_blocker=offloaded_checkpoint.offload_unsupported_reason(device),
            attention_kernels=tuple(metadata_cache.kernel_problems(device, self.dtype).items()),
            fp8_problem=fp8_base.unavailable_reason(device),
            grouped_mm_fast=moe_routing.grouped_mm_fast_path(device, self.dtype),
            free_bytes=free_device_memory(device) if on_gpu else None,
            usable_bytes=usable_device_memory(device) if on_gpu else None,
            reachable_bytes=reachable_device_memory(device) if on_gpu else None,
        )

    def _run_changed(self, **changes: Any) -> None:
        """New facts about the run (a refusal, resident layers handed back): decided again with the memory figures
        read for this run shape."""
        self.run = dataclasses.replace(self.run, **changes)
        self._decide()

    def expect(self, length: warm_up.RunLength, store: reuse.DecisionStore | None = None) -> None:
        """What is left of the run (and what earlier runs left in ``store``): fused kernels and step graphs,
        where automatic, are decided again and stay on only where their one-off cost pays back
        (:mod:`engine.speed.warm_up`)."""
        ledger = warm_up.WarmUpLedger.for_run(self.model, self.hf_model, self.dtype, self.device, length, store)
        self.run = dataclasses.replace(self.run, warm_up=ledger)
        self.apply(self.settings)

    @property
    def warm_up(self) -> warm_up.WarmUpLedger:
        """The run's length and earlier runs' measurements: switches with a one-off cost decide with them."""
        return self.run.warm_up

    @property
    def resident_override(self) -> int | None:
        """A fixed number of resident layers where the switch is on (tests, benches); None: what the planner fits.
        Takes effect at the next :meth:`apply`."""
        return self.run.resident_override

    @resident_override.setter
    def resident_override(self, layers: int | None) -> None:
        self.run = dataclasses.replace(self.run, resident_override=layers)

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
        self.graphs.clear()
        self._run_changed(resident_refused=reason)
        return True

    def restore_resident_layers(self) -> None:
        """Memory has room again: the resident layers are sized anew from what is reachable now."""
        self.graphs.clear()
        if self.device.type == "cuda":
            reachable = reachable_device_memory(self.device)
            self._device_facts = dataclasses.replace(self._device_facts, reachable_bytes=reachable)
        self._run_changed(resident_refused=None)

    def restore_step_graphs(self) -> None:
        """Memory has room again: step graphs given up for a shortage are captured again (a trial's verdict and a
        failed capture stay as they were)."""
        if self.graphs.failure == f"off: {GRAPHS_SHORT_OF_MEMORY}":
            self.graphs.failure = None

    def refuse_step_graphs(self, reason: str) -> None:
        """This run cannot replay its micro-batches (several GPUs, float16 loss scaling): step graphs stay off with
        ``reason``, whatever they are switched to."""
        self._run_changed(graphs_refused=reason)

    def refuse_fused_loss(self, reason: str) -> None:
        """This run's loss is not the causal-LM cross-entropy (DPO): the fused loss stays off with ``reason``."""
        self._run_changed(fused_loss_refused=reason)

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # --- per batch ------------------------------------------------------------------------------------------

    def _rows_grew(self, tokens: int) -> None:
        """A row longer than any before: the choices that depend on the longest row (automatic checkpointing and
        what reads it, chunked MLPs, resident layers) are decided again, with the memory figures read now."""
        checkpointing = self.settings.checkpointing == "auto" and tokens > self.run.checkpoint_tokens
        if tokens <= self.run.longest_tokens and not checkpointing:
            return
        self.graphs.clear()  # a longer row: captured graphs are stale, and their pool goes back before the reading
        longest = max(tokens, self.run.longest_tokens)
        self.run = dataclasses.replace(
            self.run, longest_tokens=longest, checkpoint_tokens=tokens if checkpointing else self.run.checkpoint_tokens
        )
        self._device_facts = self.read_device_facts()
        self._decide()

    def model_inputs(self, batch: PackedBatch, *, timed: bool = True) -> dict[str, Any]:
        """Model kwargs for one micro-batch (already on the device); the stock ones when every switch is off.
        ``timed=False``: an extra forward pass of the same micro-batch (DPO's reference pass), which the warm-up
        clock does not count as a micro-batch of its own."""
        self.offloader.begin_batch()
        self.residency.begin_batch()
        compiled = self.plan.is_on("fused_kernels")
        if timed:
            self.warm_up.tick(compiled, self.graphs.active, self.graphs.trial_result)
        self._rows_grew(batch.num_tokens)
        inputs = stock_model_inputs(self.model, batch)
        if self.host_embedding.on:
            self.host_embedding.stage(batch.host_input_ids)
        backend = self.plan.metadata_cache.backend if self.plan.metadata_cache is not None else None
        if backend is None:
            return inputs
        # a one-document row skips the document mask: for cuDNN, or automatically for the kernel SDPA picks
        whole_row = self.settings.attention_backend in ("auto", "cudnn")
        cudnn = self.plan.is_on("cudnn_attention")
        meta = metadata_cache.build_metadata(batch, self.device, backend, whole_row=whole_row, cudnn=cudnn)
        if compiled or self.graphs.active:  # masks built here are graph inputs, not host work inside
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
        if self.plan.is_on("fused_loss"):
            return fused_loss.fused_causal_lm_loss(
                model, inputs, labels, num_items, positions=positions, compiled=self.plan.is_on("fused_kernels")
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


def _acting(choice: Any) -> Any:
    """What a choice makes the model do: the choice without its reason (None while unresolved)."""
    return None if choice is None else dataclasses.replace(choice, reason="")


def _mode(plan: SpeedPlan) -> str:
    return plan.checkpointing.mode if plan.checkpointing is not None else "none"


def _shape(config: Any) -> ModelShape | None:
    """The model's sizes for the planner, or None where its config does not give them."""
    try:
        return ModelShape.from_config(config)
    except (AttributeError, TypeError, ValueError, KeyError):
        return None


def _fp8_coverage(frozen: list[tuple[torch.nn.Module, str, torch.nn.Linear, bool]]) -> Fp8Coverage:
    """How many frozen projections fp8 can multiply (widths multiples of 16), and of those the 4-bit weights the
    one-pass kernel can cast."""
    fits = [base for _, _, base, _ in frozen if fp8_base.fits(base.in_features, base.out_features)]
    one_pass = sum(1 for base in fits if four_bit_weights.covers(getattr(base.weight, "quant_state", None)))
    return Fp8Coverage(len(frozen), len(fits), one_pass)
