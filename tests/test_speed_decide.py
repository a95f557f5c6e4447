"""The speed plan is one pure decision from typed facts: tables of model, device and run facts against the choices,
for GPUs this machine does not have (RTX 30 and 40 series, H200, Blackwell, DGX Spark's GB10) with their
properties written out; and the controller installs only what a new decision changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from speed_models import tiny_lora_model

from engine.config import SpeedConfig
from engine.hardware import checkpoint_choice
from engine.hardware.shapes import load_shape
from engine.speed import SpeedController, step_graphs, warm_up
from engine.speed.decide import (
    TIGHT_MEMORY_COMPILED,
    DeviceFacts,
    Fp8Coverage,
    ModelFacts,
    RunFacts,
    SpeedFacts,
    decide_plan,
)
from engine.speed.plan import GraphsChoice

GIB = 2**30
INTEGRATED = "integrated-memory GPU: host and device memory are the same, offloading only adds copies"
LLAMA_8B = load_shape("llama-3.1-8b")


def qlora_8b() -> ModelFacts:
    """Llama-3.1-8B with a 4-bit base and LoRA rank 32 on every projection, as the controller reads it."""
    hidden, inter, kv = LLAMA_8B.hidden_size, LLAMA_8B.intermediate_size, LLAMA_8B.kv_dim
    read_in_recompute = 2 * (2 * hidden * hidden + 2 * hidden * kv + 2 * hidden * inter)  # all but down_proj
    return ModelFacts(
        dtype=torch.bfloat16, shape=LLAMA_8B, layers=32, fused_kernels_automatic=(True, "automatic: fused"),
        lora_groups=64, frozen_projections=224, dequant_bytes=read_in_recompute, fp8=Fp8Coverage(224, 224, 224),
        qlora=True, lora_rank=32, activation_units=hidden * 32, row_bytes_per_token=10 * inter + 8 * hidden,
    )  # fmt: skip


def gpu(capability: tuple[int, int], free_gib: float, integrated: bool = False) -> DeviceFacts:
    """A GPU's facts: what its compute capability allows, and ``free_gib`` free of an 8 GiB card (or cap)."""
    major_minor = f"sm{capability[0]}{capability[1]}"
    return DeviceFacts(
        kind="cuda",
        capability=capability,
        has_cudnn=True,
        offload_blocker=INTEGRATED if integrated else None,
        attention_kernels=(("varlen", None), ("flash_attn", "flash-attn is not installed"), ("flex", None)),
        fp8_problem=None if capability >= (8, 9) else f"needs fp8 tensor cores; this GPU is {major_minor}",
        grouped_mm_fast=capability in ((9, 0), (10, 0), (10, 3)),
        free_bytes=int(free_gib * GIB),
        usable_bytes=8 * GIB,
        reachable_bytes=8 * GIB,
    )


CPU = DeviceFacts(attention_kernels=(("varlen", "needs a GPU"), ("flash_attn", "needs a GPU"), ("flex", "no backward")))
ROW = RunFacts(longest_tokens=4096, checkpoint_tokens=4096)


def plan_for(model: ModelFacts, device: DeviceFacts, run: RunFacts = ROW, **settings: Any) -> Any:
    return decide_plan(SpeedFacts(model, device, run), SpeedConfig(**settings))


# (device, mode, fp8 on, dequantize once, cuDNN on one-document rows)
QLORA_8B_ROW = [
    pytest.param(gpu((9, 0), 6.0), "offloaded", True, True, True, id="H200 under an 8 GiB cap"),
    pytest.param(gpu((8, 9), 6.0), "offloaded", True, True, False, id="RTX 4060 8 GiB"),
    pytest.param(gpu((8, 6), 6.0), "offloaded", False, True, False, id="RTX 3070 8 GiB: no fp8 tensor cores"),
    pytest.param(gpu((12, 0), 6.0), "offloaded", True, True, False, id="RTX 5060 8 GiB (Blackwell)"),
    pytest.param(gpu((12, 1), 6.0, integrated=True), "standard", False, False, False, id="DGX Spark GB10"),
]


@pytest.mark.parametrize(("device", "mode", "fp8", "once", "cudnn"), QLORA_8B_ROW)
def test_an_8b_qlora_row_on_each_gpu(device: DeviceFacts, mode: str, fp8: bool, once: bool, cudnn: bool) -> None:
    plan = plan_for(qlora_8b(), device)
    assert plan.checkpointing.mode == mode
    assert plan.fp8_base.on is fp8 and plan.dequant_once.on is once and plan.cudnn_attention.on is cudnn
    assert plan.metadata_cache.backend == "varlen" and plan.fused_loss.on and plan.fused_kernels.on
    assert plan.lora_16bit.on and plan.lora_16bit.groups == 64
    if fp8:  # the recompute's scope, and every 4-bit weight cast to e4m3 in one pass by the compiled layers
        assert plan.fp8_base.scope == "recompute" and "224 4-bit weights go to e4m3 in one pass" in plan.fp8_base.reason
    if mode == "standard":  # GB10 shares host and device memory: no offload, so no fp8 or dequantize-once recompute
        assert INTEGRATED in plan.checkpointing.reason and "under offloaded checkpointing" in plan.fp8_base.reason
    assert "8.0 GiB reachable" in plan.resident_layers.reason
    # offloading leaves room for some layers beside the step; standard recompute keeps every layer input on the card
    assert (0 < plan.resident_layers.layers < 32) is (mode == "offloaded")
    assert plan.step_graphs == GraphsChoice(True, plan.step_graphs.reason, trial=True)


def test_a_cpu_run_gets_the_cpu_choices() -> None:
    plan = plan_for(qlora_8b(), CPU, fused_kernels=None)
    assert plan.checkpointing.reason == checkpoint_choice.CPU_REASON and plan.checkpointing.mode == "none"
    assert plan.metadata_cache.backend == "sdpa" and not plan.cudnn_attention.on
    assert not plan.fp8_base.on and not plan.dequant_once.on and not plan.host_embedding.on
    assert plan.resident_layers.layers == 0 and "only under checkpointing" in plan.resident_layers.reason
    cpu_model = dataclasses.replace(qlora_8b(), graphs_problem="CUDA graphs need an NVIDIA GPU")
    assert plan_for(cpu_model, CPU).step_graphs == GraphsChoice(False, "automatic: off; CUDA graphs need an NVIDIA GPU")


@pytest.mark.parametrize(
    ("free_gib", "tokens", "mode"),
    [(120.0, 4096, "none"), (6.0, 4096, "offloaded"), (120.0, 65536, "offloaded"), (6.0, 512, "none")],
)
def test_checkpointing_follows_free_memory_and_the_longest_row(free_gib: float, tokens: int, mode: str) -> None:
    run = RunFacts(longest_tokens=tokens, checkpoint_tokens=tokens)
    plan = plan_for(qlora_8b(), gpu((9, 0), free_gib), run)
    assert plan.checkpointing.mode == mode
    no_recompute = mode == "none"
    assert (plan.resident_layers.layers == 0) is no_recompute and plan.dequant_once.on is not no_recompute


def test_a_row_that_needs_chunks_leaves_no_room_for_resident_layers_or_graphs() -> None:
    run = RunFacts(longest_tokens=65536, checkpoint_tokens=65536)
    plan = plan_for(qlora_8b(), gpu((9, 0), 2.0), run)
    assert plan.chunked_mlp.on and "rows of 65,536 tokens" in plan.chunked_mlp.reason
    assert plan.resident_layers.layers == 0 and "needs its MLPs in chunks" in plan.resident_layers.reason
    assert plan.step_graphs == GraphsChoice(False, step_graphs.MEMORY_BOUND)
    assert plan_for(qlora_8b(), gpu((9, 0), 2.0), run, step_graphs=True).step_graphs.on  # asked for: kept


def short_run(tokens: int) -> RunFacts:
    """A 16-step run of ``tokens``-token rows: too short to earn a compile back."""
    ledger = warm_up.WarmUpLedger(length=warm_up.RunLength(steps=16, row_tokens=tokens), layers=32)
    return RunFacts(longest_tokens=tokens, checkpoint_tokens=tokens, warm_up=ledger)


def test_a_short_run_compiles_only_where_its_rows_need_the_memory_compiling_saves() -> None:
    roomy = plan_for(qlora_8b(), gpu((9, 0), 6.0), short_run(4096))
    assert not roomy.chunked_mlp.on
    assert not roomy.fused_kernels.on and "off for a 16-step run" in roomy.fused_kernels.reason
    tight = plan_for(qlora_8b(), gpu((9, 0), 2.0), short_run(65536))
    assert tight.chunked_mlp.on
    assert tight.fused_kernels.on and tight.fused_kernels.reason.endswith(TIGHT_MEMORY_COMPILED)
    assert not plan_for(qlora_8b(), gpu((9, 0), 2.0), short_run(65536), fused_kernels=False).fused_kernels.on


def test_refusals_after_the_run_started_turn_off_only_their_switch() -> None:
    before = plan_for(qlora_8b(), gpu((9, 0), 6.0))
    run = dataclasses.replace(
        ROW, graphs_refused="2 GPUs", fused_loss_refused="a DPO run's loss", resident_refused="memory ran short"
    )
    after = plan_for(qlora_8b(), gpu((9, 0), 6.0), run)
    assert after.step_graphs == GraphsChoice(False, "off: 2 GPUs")
    assert after.fused_loss.as_state() == {"on": False, "reason": "off: a DPO run's loss"}
    assert after.resident_layers.layers == 0 and "memory ran short" in after.resident_layers.reason
    changed = {f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)}
    assert changed == {"step_graphs", "fused_loss", "resident_layers"}


def test_explicit_settings_win_and_say_so() -> None:
    plan = plan_for(
        qlora_8b(), gpu((9, 0), 6.0), checkpointing="standard", fp8_base="all", resident_layers=False,
        attention_backend="flex", step_graphs=False,
    )  # fmt: skip
    assert plan.checkpointing.reason == "standard requested" and plan.metadata_cache.backend == "flex"
    assert plan.fp8_base.on and plan.fp8_base.scope == "all" and not plan.dequant_once.on
    assert plan.resident_layers.reason == "switched off: checkpointing recomputes every layer"
    assert plan.step_graphs.reason == "switched off: every micro-batch launches its work from Python"
    assert "flex" in plan.cudnn_attention.reason and not plan.cudnn_attention.on


def test_the_decision_follows_only_its_facts_whatever_was_decided_before() -> None:
    """The 8B QLoRA row on an H200-class card with 6 GiB free, decided before and after other decisions (a CPU, a
    card with room to spare, every switch forced off): the same choices each time, the ones the rules give for it."""
    facts = SpeedFacts(qlora_8b(), gpu((9, 0), 6.0), ROW)
    copy = dataclasses.replace(facts)
    first = decide_plan(facts, SpeedConfig())
    decide_plan(SpeedFacts(qlora_8b(), gpu((9, 0), 120.0), ROW), SpeedConfig())
    decide_plan(facts, SpeedConfig.stock())
    decide_plan(dataclasses.replace(facts, device=gpu((8, 6), 2.0)), SpeedConfig(checkpointing="standard"))
    again = decide_plan(facts, SpeedConfig())
    assert facts == copy, "the facts are read, never changed"
    # what the rules give for these facts, written out: activations do not fit in 6 GiB, so layer inputs are
    # offloaded; a dense 4-bit base under offloaded checkpointing on an fp8 card multiplies in fp8 in the recompute;
    # rows of up to 8,192 tokens keep whole MLPs; a bf16 model runs 16-bit LoRA
    for plan in (first, again):
        assert plan.checkpointing.mode == "offloaded" and plan.dequant_once.on
        assert (plan.fp8_base.on, plan.fp8_base.scope) == (True, "recompute")
        assert not plan.chunked_mlp.on and plan.lora_16bit.on and plan.moe_routing.mode == "stock"
    assert again == first


def test_a_live_switch_installs_only_what_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switching the fused loss off touches nothing but the step graphs (a new setting tries them afresh); switching
    checkpointing sets its function once and what reads it."""
    ctl = SpeedController(tiny_lora_model("llama"), SpeedConfig(checkpointing="offloaded"), torch.device("cpu"))
    calls: list[str] = []
    parts = {"checkpoint function": (ctl.hf_model, "_set_gradient_checkpointing"), "chunks": (ctl.chunked, "install"),
             "lean recompute": (ctl.lean, "switch"), "compiled regions": (ctl.region_compiler, "switch"),
             "16-bit LoRA": (ctl.lora_16bit, "switch"), "step graphs": (ctl.graphs, "switch")}  # fmt: skip
    for part, (owner, name) in parts.items():
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _part=part, _real=real, **k: calls.append(_part) or _real(*a, **k))
    ctl.apply(dataclasses.replace(ctl.settings, fused_loss=False))
    assert calls == ["step graphs"] and not ctl.plan.is_on("fused_loss")  # a new setting: graphs start over
    calls.clear()
    ctl.apply(dataclasses.replace(ctl.settings, checkpointing="standard"))
    assert calls == ["checkpoint function", "lean recompute", "compiled regions", "step graphs"]
    assert ctl.plan.checkpointing.mode == "standard" and ctl.hf_model.is_gradient_checkpointing
    ctl.apply(dataclasses.replace(ctl.settings, checkpointing="none"))
    assert not ctl.hf_model.is_gradient_checkpointing


def test_the_controller_reads_the_facts_the_decision_needs() -> None:
    ctl = SpeedController(tiny_lora_model("llama"), SpeedConfig(), torch.device("cpu"))
    facts = ctl.facts()
    # the tiny llama of speed_models: 2 layers, hidden 64, 7 adapted projections a layer
    assert facts.model.layers == 2 and facts.model.activation_units == 64 * 2 and facts.model.frozen_projections == 14
    assert "float32" in str(facts.model.lora_16bit_problem) and facts.model.lora_groups == 0  # nothing to group
    assert facts.device.kind == "cpu" and facts.device.free_bytes is None
    # and what a float32 model on a CPU gets from them: no recompute (host memory is plenty), no 16-bit LoRA, no
    # compiled kernels, no fp8, no step graphs; the fused loss stays on
    plan = ctl.plan
    assert plan.checkpointing.mode == "none" and not plan.lora_16bit.on and not plan.fused_kernels.on
    assert not plan.fp8_base.on and not plan.step_graphs.on and plan.fused_loss.on


def test_the_groups_the_plan_names_are_the_groups_installed() -> None:
    ctl = SpeedController(tiny_lora_model("llama").to(torch.bfloat16), SpeedConfig(), torch.device("cpu"))
    assert ctl.plan.lora_16bit.groups == len(ctl.lora_groups.groups) == 4
    ctl.apply(SpeedConfig(lora_16bit=False))
    assert ctl.plan.lora_16bit.groups == len(ctl.lora_groups.groups) == 0
    ctl.apply(SpeedConfig())
    assert ctl.plan.lora_16bit.groups == len(ctl.lora_groups.groups) == 4
