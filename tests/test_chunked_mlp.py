"""Per-token modules over sequence chunks: the same outputs and gradients as over the whole row."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from speed_models import grads, max_relative_error, packed_batch, step, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController
from engine.speed.chunked_mlp import AUTO_MIN_TOKENS, TokenChunked, chunked_call, resolve

BATCH = packed_batch((23, 9, 17))  # 49 tokens: chunks of 8 leave a short last chunk
BASE = SpeedConfig(metadata_cache=False, checkpointing="none", moe_routing="stock", fused_loss=False)


def controller(model: torch.nn.Module, chunk_tokens: int | None, **settings: object) -> SpeedController:
    ctl = SpeedController(model, dataclasses.replace(BASE, chunked_mlp=chunk_tokens is not None, **settings), "cpu")
    if chunk_tokens is not None:
        ctl.chunked.install(chunk_tokens)
    return ctl


def run_once(model_type: str, chunk_tokens: int | None, checkpointing: str) -> tuple[torch.Tensor, ...]:
    model = tiny_lora_model(model_type, seed=1)  # LoRA on q/k/v/o and gate/up/down, nonzero B
    ctl = controller(model, chunk_tokens, checkpointing=checkpointing)
    loss, logits = step(model, ctl.model_inputs(BATCH), BATCH)
    return loss, logits, grads(model)  # type: ignore[return-value]


@pytest.mark.parametrize("checkpointing", ["none", "standard", "offloaded"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_chunked_matches_whole_row(model_type: str, checkpointing: str) -> None:
    ref_loss, ref_logits, ref_grads = run_once(model_type, None, "none")
    loss, logits, got_grads = run_once(model_type, 8, checkpointing)
    assert float((loss - ref_loss).abs()) <= 1e-6 * float(ref_loss.abs())
    # chunks of 8 rows run other GEMM kernels than the whole row: float32 rounding, which varies with the CPU's BLAS
    assert float((logits - ref_logits).abs().max()) <= 1e-5 * float(ref_logits.abs().max())
    assert any("mlp.down_proj.lora_A" in name for name in got_grads)
    assert max_relative_error(got_grads, ref_grads) <= 1e-5  # chunk gradients summed: float32 order only


def test_the_comparison_can_fail() -> None:
    _, _, ref_grads = run_once("llama", None, "none")
    model = tiny_lora_model("llama", seed=1)
    ctl = controller(model, 8, checkpointing="standard")
    first = next(m for m in model.modules() if isinstance(m, TokenChunked) and "MLP" in type(m.wrapped).__name__)
    with torch.no_grad():
        first.wrapped.down_proj.base_layer.weight.mul_(1.01)  # a 1% different MLP must show up
    step(model, ctl.model_inputs(BATCH), BATCH)
    assert max_relative_error(grads(model), ref_grads) > 1e-4


def test_without_gradients_the_chunks_fill_one_output() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.SiLU(), torch.nn.Linear(48, 16))
    hidden = torch.randn(1, 37, 16)
    with torch.no_grad():
        whole, chunked = mlp(hidden), chunked_call(mlp, hidden, 5)
    assert chunked.shape == whole.shape and torch.allclose(chunked, whole, rtol=0, atol=1e-6)


def test_names_and_state_dict_are_unchanged_and_removal_restores_the_modules() -> None:
    model = tiny_lora_model("llama")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    mlps = [layer.mlp for layer in model.base_model.model.model.layers]
    ctl = controller(model, 8)
    wrapped = [m for m in model.modules() if isinstance(m, TokenChunked)]
    assert len(wrapped) == 2 * 7 + 1  # per layer: 2 norms, q/k/v/o, mlp; and the final norm
    assert dict(model.named_parameters()) == before and list(model.state_dict()) == keys
    ctl.apply(dataclasses.replace(BASE, chunked_mlp=False))
    assert [layer.mlp for layer in model.base_model.model.model.layers] == mlps
    assert not any(isinstance(m, TokenChunked) for m in model.modules())


def test_moe_blocks_are_not_chunked() -> None:
    model = tiny_lora_model("qwen3_moe", experts=True)
    controller(model, 8)
    layers = model.base_model.model.model.layers
    assert not any(isinstance(layer.mlp, TokenChunked) for layer in layers)
    assert all(isinstance(layer.input_layernorm, TokenChunked) for layer in layers)


def train(flip_at: int | None, steps: int = 4) -> list[float]:
    model = tiny_lora_model("llama", seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ctl = controller(model, None, checkpointing="standard")
    losses = []
    for i in range(steps):
        if i == flip_at:
            ctl.apply(dataclasses.replace(BASE, checkpointing="standard", chunked_mlp=True))
            ctl.chunked.install(8)
        if flip_at is not None and i == flip_at + 1:
            ctl.apply(dataclasses.replace(BASE, checkpointing="standard", chunked_mlp=False))
        batch = packed_batch((20, 13, 11), seed=i)
        out = model(**ctl.model_inputs(batch), labels=batch.labels, num_items_in_batch=batch.trained_tokens)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    return losses


def test_flipping_mid_run_keeps_the_losses() -> None:
    assert train(1) == pytest.approx(train(None), rel=1e-6)


def test_automatic_mode_chunks_long_rows_under_checkpointing() -> None:
    assert resolve(None, "offloaded", AUTO_MIN_TOKENS + 1)[0] is True
    assert resolve(None, "offloaded", AUTO_MIN_TOKENS)[0] is False
    assert resolve(None, "none", 10 * AUTO_MIN_TOKENS)[0] is False
    assert resolve(True, "none", 10)[0] is True and resolve(False, "standard", 10**6)[0] is False
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, dataclasses.replace(BASE, checkpointing="standard"), torch.device("cpu"))
    ctl.model_inputs(BATCH)
    assert ctl.state()["chunked_mlp"]["on"] is False and "automatic" in ctl.state()["chunked_mlp"]["reason"]
    assert not any(isinstance(m, TokenChunked) for m in model.modules())


def test_chunk_size_follows_the_mlp_width() -> None:
    from transformers import LlamaConfig

    from engine.speed.chunked_mlp import choose_chunk_tokens

    llama_8b = LlamaConfig(hidden_size=4096, intermediate_size=14336)
    qwen_small = LlamaConfig(hidden_size=1024, intermediate_size=3072)
    assert choose_chunk_tokens(llama_8b) == 1024 and choose_chunk_tokens(qwen_small) == 6656
    assert choose_chunk_tokens(LlamaConfig(hidden_size=64, intermediate_size=128)) == 8192


def test_automatic_chunking_waits_until_memory_is_short() -> None:
    """On a GPU the automatic switch chunks only when one layer's unchunked work would crowd free memory."""
    from engine.speed.chunked_mlp import row_working_bytes

    class Config:
        intermediate_size, hidden_size = 14336, 4096

    tokens = 4 * AUTO_MIN_TOKENS
    working = row_working_bytes(Config(), tokens)
    assert working == tokens * (10 * 14336 + 8 * 4096)
    roomy = resolve(None, "offloaded", tokens, working_bytes=working, free_bytes=100 * working)
    tight = resolve(None, "offloaded", tokens, working_bytes=working, free_bytes=2 * working)
    assert roomy[0] is False and "fits in free GPU memory" in roomy[1]
    assert tight[0] is True


def test_each_parameter_receives_one_gradient_per_step_and_the_recompute_skips_the_mlp() -> None:
    """Chunk gradients are summed before they reach a parameter (one accumulation, as DDP's hooks expect), and
    inside an offloaded layer's recompute the MLP, whose output only feeds the discarded residual sum, is not run."""
    model = tiny_lora_model("llama", seed=1)
    ctl = controller(model, 8, checkpointing="offloaded")
    accumulations: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: accumulations.__setitem__(name, accumulations.get(name, 0) + 1)
            )
    mlp = model.base_model.model.model.layers[0].mlp
    assert isinstance(mlp, TokenChunked) and mlp.feeds_residual_only
    calls = []
    mlp.wrapped.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    step(model, ctl.model_inputs(BATCH), BATCH)
    chunks = -(-BATCH.num_tokens // 8)
    assert set(accumulations.values()) == {1}
    assert any("mlp.down_proj.lora_A" in name for name in accumulations)
    # forward (no gradients) once per chunk, recomputed with gradients once per chunk; none in the layer recompute
    assert calls == [False] * chunks + [True] * chunks


@pytest.mark.parametrize("checkpointing", ["none", "offloaded"])
def test_mlp_only_chunks_under_compiled_layers_trace_once_and_match(checkpointing: str) -> None:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from engine.speed import fused_kernels

    torch._dynamo.reset()
    counters.clear()
    _, _, ref_grads = run_once("qwen3", None, "none")
    model = tiny_lora_model("qwen3", seed=1)
    settings = dataclasses.replace(BASE, checkpointing=checkpointing, chunked_mlp=True, fused_kernels=True)
    ctl = SpeedController(model, dataclasses.replace(settings, fused_kernels=False), torch.device("cpu"))
    counter = CompileCounter()
    ctl.region_compiler = fused_kernels.RegionCompiler(backend=counter)
    ctl.apply(settings)
    ctl.chunked.install(8, mlp_only=True)
    ctl.apply(settings)
    chunked = [m for m in model.modules() if isinstance(m, TokenChunked)]
    assert chunked and all("MLP" in type(m.wrapped).__name__ for m in chunked)
    frames = []
    for _ in range(3):
        step(model, ctl.model_inputs(BATCH), BATCH)
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[-1] == frames[0], frames
    assert sum(counters["graph_break"].values()) == 0
    assert max_relative_error(grads(model), ref_grads) <= 1e-5
    torch._dynamo.reset()


def test_a_norm_after_the_mlp_keeps_the_recompute_exact() -> None:
    """Gemma-style layers normalise the MLP's output before the residual sum: its recompute must run."""
    ref_loss, _, ref_grads = run_once("gemma2", None, "none")
    model = tiny_lora_model("gemma2", seed=1)
    ctl = controller(model, 8, checkpointing="offloaded")
    mlp = model.base_model.model.model.layers[0].mlp
    assert isinstance(mlp, TokenChunked) and not mlp.feeds_residual_only
    loss, _ = step(model, ctl.model_inputs(BATCH), BATCH)
    assert float((loss - ref_loss).abs()) <= 1e-6 * float(ref_loss.abs())
    assert max_relative_error(grads(model), ref_grads) <= 1e-5
