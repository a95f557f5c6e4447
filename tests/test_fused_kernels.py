"""Compiled layer regions against the eager reference: outputs, gradients, switching, graph breaks, recompiles.

Inductor compiles slowly on CPU (~15 s a model), so only the equivalence tests use it; the tracing tests
(checkpointing modes, attention paths, recompiles) count graphs with dynamo's CompileCounter backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch._dynamo
from speed_models import grads, max_relative_error, packed_batch, tiny_lora_model
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from engine.config import SpeedConfig
from engine.speed import SpeedController, fused_kernels

LENGTHS = [(9, 20, 5), (30, 4), (12, 12, 12, 7), (25, 7, 3, 9), (40,)]
EAGER = SpeedConfig(metadata_cache=True, checkpointing="none", fused_loss=True, fused_kernels=False)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def controller(model: Any, settings: SpeedConfig, backend: Any = "inductor") -> SpeedController:
    ctl = SpeedController(model, dataclasses.replace(settings, fused_kernels=False), torch.device("cpu"))
    ctl.region_compiler = fused_kernels.RegionCompiler(backend=backend)
    ctl.apply(settings)
    return ctl


def step_loss(model: Any, ctl: SpeedController, lengths: tuple[int, ...], seed: int) -> float:
    batch = packed_batch(lengths, seed=seed)
    loss = ctl.loss(model, ctl.model_inputs(batch), batch.labels, batch.trained_tokens, positions=batch.loss_positions)
    loss.backward()
    return float(loss.detach())


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def frames_matching_eager(
    model: Any, ctl: SpeedController, reference_model: Any, reference: SpeedController, counter: Any, rows: list
) -> list[int]:
    """One step per row on both models, loss and gradients checked against the eager reference; the compiled
    frames counted after each step."""
    frames = []
    for seed, lengths in enumerate(rows):
        got = step_loss(model, ctl, lengths, seed)
        want = step_loss(reference_model, reference, lengths, seed)
        # the regions are traced as-is; the loss's softmax gradient is compiled kernels: float32 rounding only
        assert got == pytest.approx(want, rel=1e-6)
        assert max_relative_error(grads(model), grads(reference_model)) < 1e-5
        model.zero_grad(set_to_none=True)
        reference_model.zero_grad(set_to_none=True)
        frames.append(counter.frame_count)
    return frames


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_compiled_layers_match_eager_and_never_recompile(model_type: str) -> None:
    """fp32 loss and every LoRA gradient equal to eager; rows of new lengths reuse the first (dynamic) graphs."""
    model = tiny_lora_model(model_type)
    ctl = controller(model, EAGER)
    want = step_loss(model, ctl, LENGTHS[0], seed=0)
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    ctl.apply(dataclasses.replace(EAGER, fused_kernels=True))
    got = step_loss(model, ctl, LENGTHS[0], seed=0)
    assert got == pytest.approx(want, rel=1e-5)
    assert max_relative_error(grads(model), want_grads) < 1e-5
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "the regions were compiled"
    for seed, lengths in enumerate(LENGTHS[1:4], start=1):
        model.zero_grad(set_to_none=True)
        step_loss(model, ctl, lengths, seed)
    assert counters["stats"]["unique_graphs"] == graphs, "a new row length recompiled"
    assert graph_breaks() == 0, dict(counters["graph_break"])


@pytest.mark.slow
def test_switching_mid_run_keeps_the_loss_curve() -> None:
    """Eager, then compiled from step 2, then eager again from step 4: the losses of a run that never switched."""

    def train(switch: bool) -> list[float]:
        model = tiny_lora_model("llama", seed=3)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ctl = controller(model, EAGER)
        losses = []
        for i, lengths in enumerate(LENGTHS):
            if switch and i in (2, 4):
                ctl.apply(dataclasses.replace(EAGER, fused_kernels=i == 2))
            losses.append(step_loss(model, ctl, lengths, seed=i))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses

    reference = train(switch=False)
    assert counters["stats"]["unique_graphs"] == 0
    switched = train(switch=True)
    assert counters["stats"]["unique_graphs"] > 0
    assert switched == pytest.approx(reference, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    ("metadata_cache", "checkpointing"),
    [(True, "standard"), (True, "offloaded"), (False, "standard"), (False, "none")],
)
def test_checkpointing_and_attention_paths_trace_whole_regions(metadata_cache: bool, checkpointing: str) -> None:
    """Standard and offloaded recompute, packed and stock attention: no graph break, no recompile per row."""
    model = tiny_lora_model("qwen3")
    settings = SpeedConfig(metadata_cache=metadata_cache, checkpointing=checkpointing, fused_kernels=True)
    reference_model = tiny_lora_model("qwen3")
    reference = controller(reference_model, dataclasses.replace(settings, fused_kernels=False))
    counter = CompileCounter()
    ctl = controller(model, settings, backend=counter)
    frames = frames_matching_eager(model, ctl, reference_model, reference, counter, LENGTHS[:4])
    assert frames[0] > 0 and frames[-1] == frames[0], f"graphs per step: {frames}"
    assert graph_breaks() == 0, dict(counters["graph_break"])


def test_switch_states_and_automatic_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, SpeedConfig(), torch.device("cpu"))
    regions = fused_kernels.compile_regions(ctl.hf_model)
    assert len(regions) == 2 * 4  # attention, MLP and two norms in each of the two layers
    state = ctl.state()["fused_kernels"]
    assert state == {"on": False, "reason": state["reason"]} and "CPU" in state["reason"]
    assert all(region._compiled_call_impl is None for region in regions)
    ctl.apply(SpeedConfig(fused_kernels=True))
    assert ctl.state()["fused_kernels"]["on"] and all(r._compiled_call_impl is not None for r in regions)
    ctl.apply(SpeedConfig(fused_kernels=False))
    assert ctl.state()["fused_kernels"]["reason"].startswith("switched off")
    assert all(region._compiled_call_impl is None for region in regions)
    cuda = torch.device("cuda")
    monkeypatch.setattr(fused_kernels.importlib.util, "find_spec", lambda name: object())
    assert fused_kernels.resolve(None, ctl.hf_model, cuda)[0]
    assert not fused_kernels.resolve(None, tiny_lora_model("qwen3_moe").base_model.model, cuda)[0]
    monkeypatch.setattr(fused_kernels.importlib.util, "find_spec", lambda name: None)
    on, reason = fused_kernels.resolve(None, ctl.hf_model, cuda)
    assert not on and "triton" in reason


def test_chunked_mlp_regions_compile_the_chunked_modules_without_breaks() -> None:
    """With per-token modules in sequence chunks, the wrapped modules are compiled and run once per chunk."""
    from engine.speed.chunked_mlp import TokenChunked

    settings = SpeedConfig(metadata_cache=True, checkpointing="standard", chunked_mlp=True, fused_kernels=True)
    model, reference_model = tiny_lora_model("llama"), tiny_lora_model("llama")
    counter = CompileCounter()
    ctl = controller(model, settings, backend=counter)
    reference = controller(reference_model, dataclasses.replace(settings, fused_kernels=False))
    for wrapper in [m for m in model.modules() if isinstance(m, TokenChunked)]:
        wrapper.chunk_tokens = 16  # rows of 34-40 tokens: two or three chunks
    for wrapper in [m for m in reference_model.modules() if isinstance(m, TokenChunked)]:
        wrapper.chunk_tokens = 16
    regions = fused_kernels.compile_regions(ctl.hf_model)
    assert regions and not any(isinstance(r, TokenChunked) for r in regions)
    assert all(r._compiled_call_impl is not None for r in regions)
    for seed, lengths in enumerate(LENGTHS[:3]):
        assert step_loss(model, ctl, lengths, seed) == pytest.approx(
            step_loss(reference_model, reference, lengths, seed)
        )
        # float32 noise: the compiled chunks accumulate the frozen products' gradients in another order
        assert max_relative_error(grads(model), grads(reference_model)) < 1e-5
        model.zero_grad(set_to_none=True)
        reference_model.zero_grad(set_to_none=True)
    assert {w.chunk_tokens for w in model.modules() if isinstance(w, TokenChunked)} == {16}  # the rows ran in chunks
    assert counter.frame_count > 0 and graph_breaks() == 0, dict(counters["graph_break"])
    ctl.apply(dataclasses.replace(settings, chunked_mlp=False))  # the whole attention block is a region again
    assert all(r._compiled_call_impl is None for r in regions if r not in fused_kernels.compile_regions(ctl.hf_model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("backend", ["varlen", "flex", "sdpa"])
def test_cuda_attention_backends_compile_once_and_match_eager(backend: str) -> None:
    """On the GPU: cu_seqlens and max_seqlen change with every row, yet the inductor graphs are reused."""
    device = torch.device("cuda")
    settings = SpeedConfig(metadata_cache=True, attention_backend=backend, checkpointing="none", fused_kernels=True)
    losses: dict[bool, list[float]] = {}
    for fused in (False, True):
        counters.clear()
        model = tiny_lora_model("qwen3").to(device, torch.bfloat16)
        ctl = SpeedController(model, dataclasses.replace(settings, fused_kernels=fused), device)
        assert ctl.state()["metadata_cache"]["backend"] == backend
        losses[fused] = []
        for seed, lengths in enumerate(LENGTHS[:4]):
            batch = packed_batch(tuple(n * 8 for n in lengths), seed=seed).to(device)
            inputs = ctl.model_inputs(batch)
            loss = ctl.loss(model, inputs, batch.labels, batch.trained_tokens, positions=batch.loss_positions)
            loss.backward()
            losses[fused].append(float(loss.detach()))
            if seed == 0:
                graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new row length recompiled"
    assert graphs > 0 and graph_breaks() == 0, dict(counters["graph_break"])
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
