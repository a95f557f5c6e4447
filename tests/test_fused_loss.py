"""The fused linear cross-entropy against a float32 reference, end to end against stock, and its memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from speed_models import VOCAB, grads, max_relative_error, packed_batch, tiny_lora_model
from torch.nn import functional as F

from engine.config import SpeedConfig
from engine.data.model_inputs import stock_model_inputs
from engine.speed import SpeedController
from engine.speed.fused_loss import (
    IGNORE_INDEX,
    LinearCrossEntropy,
    choose_chunk_size,
    compiled_softmax_cross_entropy_grad,
    fused_causal_lm_loss,
    linear_cross_entropy,
    linear_cross_entropy_sum,
    softmax_cross_entropy_grad,
    softmax_cross_entropy_grad_pointwise,
    unsupported_reason,
)


def reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, divisor: float) -> torch.Tensor:
    """transformers' path: full logits, float32, cross-entropy summed over counted tokens / divisor."""
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / divisor


def leaves(n: int, h: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(fn, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    hidden.grad = weight.grad = None
    loss = fn()
    (loss * 0.7).backward()  # a non-unit incoming gradient: the backward must scale the saved gradients
    return float(loss.detach()), hidden.grad.clone(), weight.grad.clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 1000])
def test_core_matches_float32_reference_for_every_chunk_size(chunk: int) -> None:
    hidden, weight, labels = leaves(61, 24, 97, seed=chunk)  # vocab and tokens not multiples of any chunk
    divisor = float((labels != IGNORE_INDEX).sum() + 3)
    want = loss_and_grads(lambda: reference(hidden, weight, labels, divisor), hidden, weight)
    got = loss_and_grads(lambda: LinearCrossEntropy.apply(hidden, weight, None, labels, divisor, chunk), hidden, weight)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert rel(got[1], want[1]) < 1e-5 and rel(got[2], want[2]) < 1e-5
    ignored = labels == IGNORE_INDEX
    assert torch.all(got[1][ignored] == 0)


def test_tied_embeddings_get_both_gradients() -> None:
    """Tied input/output embeddings: the weight's gradient is the sum of the lookup's and the head's."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(50, 12, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :3] = IGNORE_INDEX

    def run(fused: bool) -> tuple[float, torch.Tensor]:
        table.grad = None
        hidden = torch.tanh(F.embedding(ids, table))
        if fused:
            loss = linear_cross_entropy(hidden, table, labels, num_items=11, chunk_size=4)
        else:
            shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
            loss = reference(hidden.reshape(-1, 12), table, shifted, 11.0)
        loss.backward()
        return float(loss), table.grad.clone()

    (want, want_grad), (got, got_grad) = run(False), run(True)
    assert got == pytest.approx(want, rel=1e-5) and rel(got_grad, want_grad) < 1e-5


def test_mean_without_num_items_and_no_gradient_under_no_grad() -> None:
    hidden, weight, labels = leaves(20, 8, 31, seed=5)
    want = F.cross_entropy(hidden[:-1] @ weight.t(), labels[1:], ignore_index=IGNORE_INDEX)
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, labels, chunk_size=6)
    assert not got.requires_grad and float(got) == pytest.approx(float(want), rel=1e-5)


def test_float16_loss_scale_neither_overflows_nor_flushes_gradients() -> None:
    """GradScaler's 65536 is above float16's largest value: it must only meet float32 tensors."""
    hidden, weight, labels = leaves(40, 16, 64, seed=11)
    exact = torch.autograd.grad(reference(hidden, weight, labels, 4000.0) * 65536.0, hidden)[0]
    half = hidden.detach().half().requires_grad_()
    loss = LinearCrossEntropy.apply(half, weight.detach().half(), None, labels, 4000.0, 8)
    (got,) = torch.autograd.grad(loss * 65536.0, half)
    assert torch.isfinite(got).all() and rel(got.float(), exact) < 2e-3


def test_a_micro_batch_with_nothing_to_learn_gives_zero_loss_and_zero_gradient() -> None:
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, torch.randn(11, 8), torch.full((2, 5), IGNORE_INDEX), num_items=7)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(hidden.grad == 0)


class RecordedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the aten operations run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_packer_positions_equal_the_device_search_and_spare_its_sync() -> None:
    """collate lists the trained positions on the host; with them the loss never runs nonzero (a host sync)."""
    batch = packed_batch((5, 11, 1, 8))
    shifted = F.pad(batch.labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    assert batch.loss_positions.tolist() == (shifted != IGNORE_INDEX).nonzero().squeeze(1).tolist()
    assert batch.loss_positions.dtype == torch.long and batch.to("cpu").loss_positions is not None
    assert batch.trained_tokens == int((shifted != IGNORE_INDEX).sum())  # counted without reading the labels
    hidden = torch.randn(1, batch.num_tokens, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8)
    results = {}
    for positions in (None, batch.loss_positions):
        with RecordedOps() as ops:
            loss = linear_cross_entropy(hidden, weight, batch.labels, num_items=17, chunk_size=8, positions=positions)
            (grad,) = torch.autograd.grad(loss, hidden)
        results[positions is None] = (float(loss), grad, "nonzero" in ops.names)
    (host_loss, host_grad, host_searched), (device_loss, device_grad, device_searched) = results[False], results[True]
    assert device_searched and not host_searched  # the check sees nonzero when it runs
    assert host_loss == device_loss and torch.equal(host_grad, device_grad)


def test_chunk_size_keeps_float32_logits_within_budget() -> None:
    assert choose_chunk_size(16384, 151936) * 151936 * 4 <= 256 * 2**20
    assert choose_chunk_size(16384, 151936) % 16 == 0
    assert choose_chunk_size(10, 256) == 10


def lora_loss_and_grads(model_type: str, tied: bool, dtype: torch.dtype, fused: bool) -> tuple[float, dict]:
    """Loss and float32 gradients of one packed micro-batch through a tiny LoRA model (same seed every call)."""
    model = tiny_lora_model(model_type, tie_word_embeddings=tied).to(dtype)
    if tied:  # the tied table trains too: it gets the lookup's and the head's gradient
        model.get_input_embeddings().weight.requires_grad_(True)
    batch = packed_batch((5, 11, 8))
    inputs = stock_model_inputs(model, batch)
    if fused:
        loss = fused_causal_lm_loss(model, inputs, batch.labels, batch.trained_tokens)
    else:
        loss = model(**inputs, labels=batch.labels, num_items_in_batch=batch.trained_tokens).loss
    loss.backward()
    assert loss.dtype == torch.float32
    return float(loss), {k: v.float() for k, v in grads(model).items()}


@pytest.mark.parametrize(
    ("model_type", "tied"), [("llama", False), ("qwen3", True), ("qwen3_moe", False), ("gpt_oss", False)]
)
def test_tiny_model_with_lora_matches_stock_loss_and_gradients(model_type: str, tied: bool) -> None:
    stock_loss, stock_grads = lora_loss_and_grads(model_type, tied, torch.float32, fused=False)
    fused_loss, fused_grads = lora_loss_and_grads(model_type, tied, torch.float32, fused=True)
    assert fused_loss == pytest.approx(stock_loss, rel=1e-5)
    assert max_relative_error(fused_grads, stock_grads) < 1e-5
    assert not tied or any("embed_tokens" in k for k in fused_grads)


def test_bfloat16_stays_within_the_stock_paths_own_rounding_noise() -> None:
    exact_loss, exact = lora_loss_and_grads("qwen3", True, torch.float32, fused=False)
    stock_loss, stock = lora_loss_and_grads("qwen3", True, torch.bfloat16, fused=False)
    fused_loss, fused = lora_loss_and_grads("qwen3", True, torch.bfloat16, fused=True)
    assert abs(fused_loss - exact_loss) <= 2 * abs(stock_loss - exact_loss) + 1e-3
    assert max_relative_error(fused, exact) <= 2 * max_relative_error(stock, exact)


def test_controller_switch_and_fallbacks() -> None:
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, SpeedConfig(), torch.device("cpu"))
    assert ctl.state()["fused_loss"]["on"] and ctl.state()["fused_loss"]["reason"].startswith("automatic: loss")
    ctl.apply(SpeedConfig(fused_loss=True))
    assert ctl.state()["fused_loss"]["on"]
    ctl.apply(SpeedConfig(fused_loss=False))
    assert ctl.state()["fused_loss"] == {
        "on": False,
        "reason": "switched off: the model's own head and transformers' loss",
    }
    softcapped = tiny_lora_model("llama")
    softcapped.base_model.model.config.final_logit_softcapping = 30.0
    assert "soft-capping" in unsupported_reason(softcapped.base_model.model)
    routed = tiny_lora_model("qwen3_moe")
    assert unsupported_reason(routed.base_model.model) is None
    routed.base_model.model.config.output_router_logits = True
    assert "auxiliary loss" in unsupported_reason(routed.base_model.model)


def test_lora_on_the_head_falls_back_with_a_reason() -> None:
    from peft import LoraConfig, get_peft_model
    from speed_models import tiny_config
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_config(tiny_config("llama")), LoraConfig(target_modules=["lm_head"])
    )
    ctl = SpeedController(model, SpeedConfig(fused_loss=True), torch.device("cpu"))
    assert not ctl.state()["fused_loss"]["on"] and "LoRA" in ctl.state()["fused_loss"]["reason"]


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any operation produces (only those with a dimension ``of_size`` when given)."""

    def __init__(self, of_size: int | None = None) -> None:
        super().__init__()
        self.largest = 0
        self.of_size = of_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and (self.of_size is None or self.of_size in t.shape):
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_path_never_materialises_tokens_times_vocab() -> None:
    n, h, v, chunk = 512, 16, 4096, 32
    hidden, weight, labels = leaves(n, h, v, seed=9)
    weight.requires_grad_(False)
    for fused in (True, False):
        with LargestTensor() as mode:
            loss = (
                LinearCrossEntropy.apply(hidden, weight, None, labels, 100.0, chunk)
                if fused
                else reference(hidden, weight, labels, 100.0)
            )
            loss.backward()
        if fused:
            assert mode.largest <= max(chunk * v, n * h)  # one chunk's logits at most
        else:
            assert mode.largest >= n * v  # the check can see full logits when they exist


def test_model_path_never_materialises_tokens_times_vocab() -> None:
    model = tiny_lora_model("llama")
    batch = packed_batch((30, 40, 26))
    inputs = stock_model_inputs(model, batch)
    tokens, chunk = batch.input_ids.numel(), 16
    for fused in (True, False):
        with LargestTensor(of_size=VOCAB) as mode:
            if fused:
                loss = fused_causal_lm_loss(model, inputs, batch.labels, batch.trained_tokens, chunk_size=chunk)
            else:
                loss = model(**inputs, labels=batch.labels, num_items_in_batch=batch.trained_tokens).loss
            loss.backward()
        if fused:  # one chunk's logits, or the head's own (vocab × hidden) weight
            assert mode.largest <= max(chunk * VOCAB, model.get_output_embeddings().weight.numel())
        else:
            assert mode.largest >= tokens * VOCAB


def test_switch_flipped_mid_run_keeps_the_loss_curve(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    from test_train import assert_same_curve, finish, losses, make_config

    from engine.events import SpeedChanged, StepMetrics
    from engine.run.control import RunControl
    from engine.train import run

    stock = make_config(tiny_model_dir, chat_file, tmp_path / "a", max_steps=4)
    stock.speed.fused_loss = False
    reference_dir = Path(finish(run(stock))[-1].run_dir)
    control = RunControl()
    changes = []
    fused = make_config(tiny_model_dir, chat_file, tmp_path / "b", max_steps=4)
    fused.speed.fused_loss = True
    for event in run(fused, control=control):
        if isinstance(event, StepMetrics) and event.step == 2:
            control.request_speed(SpeedConfig(fused_loss=False))
        if isinstance(event, SpeedChanged):
            changes.append(event)
    assert [c.step for c in changes] == [0, 2]
    assert changes[0].state["fused_loss"]["on"] and not changes[1].state["fused_loss"]["on"]
    assert_same_curve(losses(tmp_path / "b" / "run"), losses(reference_dir))


def chunk_inputs(n: int, v: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_softmax_gradient_equals_the_reference(dtype: torch.dtype) -> None:
    logits, labels = chunk_inputs(37, 300, dtype, seed=1)
    want_loss, want_grad = softmax_cross_entropy_grad(logits.clone(), labels, 0.5)
    got_loss, got_grad = softmax_cross_entropy_grad_pointwise(logits, labels, 0.5)
    assert got_grad.dtype == dtype and got_loss.dtype == torch.float32
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert torch.allclose(got_grad.float(), want_grad.float(), rtol=1e-5, atol=1e-7 if dtype == torch.float32 else 1e-3)
    assert torch.all(got_grad[::5] == 0)


@pytest.mark.slow
def test_compiled_softmax_gradient_matches_eager_for_every_chunk_length() -> None:
    """The compiled kernels (inductor on the CPU here, Triton on GPUs) against the reference, lengths varying."""
    import torch._dynamo

    torch._dynamo.reset()
    kernel = compiled_softmax_cross_entropy_grad()
    for seed, n in enumerate((48, 17, 48, 5)):
        logits, labels = chunk_inputs(n, 256, torch.float32, seed)
        want_loss, want_grad = softmax_cross_entropy_grad(logits.clone(), labels, 1.0)
        got_loss, got_grad = kernel(logits, labels, 1.0)
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
        assert torch.allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    hidden, weight, labels = leaves(40, 16, 256, seed=3)
    eager = linear_cross_entropy_sum(hidden.detach(), weight.detach(), labels, chunk_size=16)
    fast = linear_cross_entropy_sum(hidden.detach(), weight.detach(), labels, chunk_size=16, compiled=True)
    assert float(fast[0]) == pytest.approx(float(eager[0]), rel=1e-5)
    assert torch.allclose(fast[1], eager[1], rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()
