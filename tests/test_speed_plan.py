"""Checkpointing is decided in one place (engine.hardware.checkpoint_choice): tables of facts and settings against
the mode and reason, the planner's choices for common cards and models, and the planner, the device profile, the
speed controller and the out-of-memory fallback all following that one function."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from speed_models import tiny_lora_model

from engine.config import SpeedConfig
from engine.hardware import checkpoint_choice, gpus
from engine.hardware.checkpoint_choice import CheckpointFacts, CheckpointPlan, decide_checkpointing
from engine.hardware.planner import GIB, choose_memory_settings
from engine.hardware.profile import DeviceTarget, build_profile
from engine.hardware.shapes import load_shape
from engine.run import guard
from engine.speed import SpeedController, offloaded_checkpoint
from engine.speed.decide import DeviceFacts, RunFacts, SpeedFacts, decide_plan
from engine.speed.plan import Choice, ResidentChoice, SpeedPlan

INTEGRATED = "integrated-memory GPU: host and device memory are the same, offloading only adds copies"
GPU_FITS = (("none", 4096), ("offloaded", 16384), ("standard", 12288))

DECISIONS = [
    # (facts, requested) -> (mode, reason)
    (CheckpointFacts(on_gpu=False), "auto", "none", checkpoint_choice.CPU_REASON),
    (CheckpointFacts(on_gpu=True), "auto", "standard", checkpoint_choice.NO_MODEL_REASON),
    (CheckpointFacts(True, fits=GPU_FITS, wanted_tokens=4096), "auto", "none", checkpoint_choice.FITS_REASON),
    (CheckpointFacts(True, fits=GPU_FITS, wanted_tokens=8192), "auto", "offloaded", checkpoint_choice.OFFLOAD_REASON),
    # no recompute still wins when it fits as much as the best checkpointed mode
    (CheckpointFacts(True, fits=(("none", 8192), ("offloaded", 8192)), wanted_tokens=16384), "auto", "none",
     checkpoint_choice.FITS_REASON),
    # a tie between the checkpointed modes goes to offloaded
    (CheckpointFacts(True, fits=(("none", 1024), ("standard", 8192), ("offloaded", 8192)), wanted_tokens=8192),
     "auto", "offloaded", checkpoint_choice.OFFLOAD_REASON),
    (CheckpointFacts(True, fits=(("none", 1024), ("offloaded", 4096), ("standard", 6144)), wanted_tokens=8192),
     "auto", "standard", checkpoint_choice.RECOMPUTE_REASON),
    # unbounded modes (the speed controller knows only how long a row fits without recompute)
    (CheckpointFacts(True, fits=(("none", 2048), ("offloaded", None), ("standard", None)), wanted_tokens=2048),
     "auto", "none", checkpoint_choice.FITS_REASON),
    (CheckpointFacts(True, fits=(("none", 2048), ("offloaded", None), ("standard", None)), wanted_tokens=2049),
     "auto", "offloaded", checkpoint_choice.OFFLOAD_REASON),
    (CheckpointFacts(True, INTEGRATED, fits=(("none", 2048), ("standard", None)), wanted_tokens=4096), "auto",
     "standard", f"activations would not fit; {INTEGRATED}"),
    # explicit settings win, whatever the memory says
    (CheckpointFacts(True, fits=GPU_FITS, wanted_tokens=4096), "offloaded", "offloaded", "offloaded requested"),
    (CheckpointFacts(False), "standard", "standard", "standard requested"),
    (CheckpointFacts(True, fits=GPU_FITS, wanted_tokens=65536), "none", "none", "none requested"),
    # ... except offloading where it cannot work
    (CheckpointFacts(True, INTEGRATED), "offloaded", "standard",
     f"offloaded requested but {INTEGRATED}; plain recompute instead"),
]  # fmt: skip


@pytest.mark.parametrize(("facts", "requested", "mode", "reason"), DECISIONS)
def test_checkpointing_decision_table(facts: CheckpointFacts, requested: Any, mode: str, reason: str) -> None:
    plan = decide_checkpointing(facts, requested)
    assert plan == CheckpointPlan(mode, reason)  # type: ignore[arg-type]
    assert plan.as_state() == {"mode": mode, "reason": reason}


def test_candidate_modes_leave_out_offloading_where_it_cannot_work() -> None:
    assert checkpoint_choice.candidate_modes(can_offload=True) == ("none", "offloaded", "standard")
    assert checkpoint_choice.candidate_modes(can_offload=False) == ("none", "standard")


def _target(gpu: str) -> DeviceTarget:
    if gpu == "cpu":
        return DeviceTarget(None, gpus.CPU, None, 64 * GIB, cpu_cores=8)
    spec = gpus.find_gpu(gpu)
    assert spec is not None
    return DeviceTarget.from_spec(spec)


PROFILES = [
    # (device, model, row length, settings the user gave) -> (checkpointing, QLoRA, tokens per batch)
    ("cpu", "llama-3.2-1b", 0, {}, "none", False, 256),
    ("RTX 4060", "llama-3.2-1b", 0, {}, "offloaded", False, 16384),  # 8 GiB, dense, bf16
    ("RTX 3060", "llama-3.2-1b", 0, {}, "offloaded", False, 16384),  # 12 GiB
    ("RTX 4090", "llama-3.2-1b", 0, {}, "none", False, 12032),  # 24 GiB: no recompute while 12k tokens fit
    ("RTX 4060", "llama-3.1-8b", 4096, {"qlora": True}, "offloaded", True, 11008),  # QLoRA 8B in 8 GiB, 4k rows
    ("RTX 4060", "llama-3.1-8b", 16384, {"qlora": True}, "offloaded", True, None),  # 16k rows do not fit
    ("H200", "llama-3.1-8b", 16384, {}, "none", False, 16384),
    ("H200", "qwen3-30b-a3b", 4096, {}, "none", False, 11776),  # MoE
    ("RTX 4090", "llama-3.2-1b", 0, {"checkpointing": "standard"}, "standard", False, 16384),  # the user's wins
]


@pytest.mark.parametrize(("gpu", "model", "row", "overrides", "mode", "qlora", "tokens"), PROFILES)
def test_planned_checkpointing_for_common_cards(
    gpu: str, model: str, row: int, overrides: dict[str, Any], mode: str, qlora: bool, tokens: int | None
) -> None:
    profile = build_profile(_target(gpu), load_shape(model), overrides=overrides, min_tokens=row)
    assert profile.memory_plan is not None
    assert profile.checkpointing.value == mode
    assert profile.qlora is not None and profile.qlora.value is qlora
    assert profile.memory_plan.tokens == tokens


def test_profile_without_a_model_uses_the_decision() -> None:
    cpu = build_profile(_target("cpu"))
    gpu = build_profile(_target("RTX 4090"))
    assert cpu.checkpointing.value == "none"
    assert cpu.checkpointing.reason == "checkpointing off: host memory is plentiful, recompute would only cost time"
    assert gpu.checkpointing.value == "standard"
    assert gpu.checkpointing.reason == f"checkpointing standard: {checkpoint_choice.NO_MODEL_REASON}"


# tiny llama: hidden 64 x 2 layers x 34 bytes = 4,352 bytes a token; 60% of 10 MB holds 1,378 tokens
CONTROLLER = [
    # (free bytes, longest row, what cannot offload) -> (mode, reason)
    (10_000_000, 1378, None, "none", checkpoint_choice.FITS_REASON),
    (10_000_000, 1379, None, "offloaded", checkpoint_choice.OFFLOAD_REASON),
    (10_000_000, 1379, INTEGRATED, "standard", f"activations would not fit; {INTEGRATED}"),
    (10_000_000, 0, INTEGRATED, "none", checkpoint_choice.FITS_REASON),
]


@pytest.mark.parametrize(("free", "tokens", "blocker", "mode", "reason"), CONTROLLER)
def test_a_run_decides_from_free_gpu_memory(
    free: int, tokens: int, blocker: str | None, mode: str, reason: str
) -> None:
    """The run's facts (the tiny model's as the controller reads them, a GPU's memory) give the mode."""
    model = SpeedController(tiny_lora_model("llama"), SpeedConfig.stock(), torch.device("cpu")).read_model_facts()
    assert model.activation_units == 64 * 2
    device = DeviceFacts(kind="cuda", capability=(9, 0), free_bytes=free, offload_blocker=blocker)
    plan = decide_plan(
        SpeedFacts(model, device, RunFacts(checkpoint_tokens=tokens)), SpeedConfig.stock(checkpointing="auto")
    )
    assert plan.checkpointing == CheckpointPlan(mode, reason)


def test_controller_on_cpu_and_explicit_settings() -> None:
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, SpeedConfig.stock(checkpointing="auto"), torch.device("cpu"))
    assert ctl.state()["checkpointing"] == {"mode": "none", "reason": checkpoint_choice.CPU_REASON}
    ctl.apply(SpeedConfig.stock(checkpointing="offloaded"))
    assert ctl.state()["checkpointing"] == {"mode": "offloaded", "reason": "offloaded requested"}


def test_out_of_memory_fallback_is_decided_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's fallback asks for offloaded checkpointing; a GPU that cannot offload gets standard recompute."""
    ctl = SpeedController(tiny_lora_model("llama"), SpeedConfig.stock(checkpointing="auto"), torch.device("cpu"))
    monkeypatch.setattr(offloaded_checkpoint, "offload_unsupported_reason", lambda device: INTEGRATED)
    ctl.apply(guard.fallback_settings(guard.OFFLOADED_CHECKPOINTING, ctl.settings))
    assert ctl.settings.checkpointing == "offloaded"
    assert ctl.state()["checkpointing"] == {
        "mode": "standard",
        "reason": f"offloaded requested but {INTEGRATED}; plain recompute instead",
    }
    assert guard.fallback_settings(guard.CHUNKED_MLP, ctl.settings).chunked_mlp is True
    assert guard.fallback_settings(guard.TOKENS_PER_BATCH, ctl.settings) == ctl.settings


def test_planner_profile_controller_and_guard_follow_one_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the one decision: every place that picks checkpointing picks what it says."""
    asked: list[tuple[CheckpointFacts, str]] = []

    def always_standard(facts: CheckpointFacts, requested: Any = "auto") -> CheckpointPlan:
        asked.append((facts, requested))
        return CheckpointPlan("standard", "decided in one place")

    monkeypatch.setattr(checkpoint_choice, "decide_checkpointing", always_standard)
    shape = load_shape("llama-3.2-1b")
    planned = choose_memory_settings(shape, 80 * GIB, min_tokens=2048)  # no recompute otherwise
    assert planned.checkpointing == "standard"
    assert build_profile(_target("cpu")).checkpointing.value == "standard"
    ctl = SpeedController(tiny_lora_model("llama"), SpeedConfig.stock(checkpointing="auto"), torch.device("cpu"))
    assert ctl.state()["checkpointing"] == {"mode": "standard", "reason": "decided in one place"}
    ctl.apply(guard.fallback_settings(guard.OFFLOADED_CHECKPOINTING, ctl.settings))
    assert ctl.state()["checkpointing"]["mode"] == "standard"
    assert asked[-1][1] == "offloaded"
    assert {requested for _, requested in asked} == {"auto", "offloaded"}


SETTINGS = [
    "metadata_cache", "cudnn_attention", "moe_routing", "fused_loss", "checkpointing", "chunked_mlp",
    "host_embedding", "lora_16bit", "dequant_once", "fp8_base", "fused_kernels", "resident_layers", "step_graphs",
]  # fmt: skip


def test_state_is_the_plan_in_its_json_shape() -> None:
    """Events, the app's Speed page and run summaries read ``state()``: one entry per setting, in apply order."""
    ctl = SpeedController(tiny_lora_model("llama"), SpeedConfig(), torch.device("cpu"))
    state = ctl.state()
    assert list(state) == SETTINGS and state == ctl.plan.as_state()
    assert json.loads(json.dumps(state)) == state
    keys = {name: set(entry) for name, entry in state.items()}
    assert keys["metadata_cache"] == {"on", "backend", "reason"}
    assert keys["checkpointing"] == keys["moe_routing"] == {"mode", "reason"}
    assert keys["lora_16bit"] == {"on", "reason", "groups"}
    assert keys["fp8_base"] == {"on", "scope", "reason"}
    assert keys["resident_layers"] == {"on", "layers", "reason"}
    assert all(keys[name] == {"on", "reason"} for name in ("fused_loss", "chunked_mlp", "step_graphs"))
    ctl.apply(SpeedConfig.stock(checkpointing="standard"))
    assert ctl.plan.checkpointing == CheckpointPlan("standard", "standard requested")
    assert ctl.state()["checkpointing"] == {"mode": "standard", "reason": "standard requested"}


def test_plan_is_frozen_and_skips_what_is_unresolved() -> None:
    plan = SpeedPlan(fused_loss=Choice(True, "on"), resident_layers=ResidentChoice(0, "none fit"))
    assert plan.as_state() == {
        "fused_loss": {"on": True, "reason": "on"},
        "resident_layers": {"on": False, "layers": 0, "reason": "none fit"},
    }
    assert plan.is_on("fused_loss") and not plan.is_on("resident_layers") and not plan.is_on("chunked_mlp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fused_loss = None  # type: ignore[misc]
