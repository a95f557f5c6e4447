"""Packed-sequence metadata cache: the packed attention path equals transformers' own packed path."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from speed_models import grads, max_relative_error, packed_batch, step, tiny_lora_model

from engine.config import SpeedConfig
from engine.data.model_inputs import block_causal_mask, stock_model_inputs
from engine.speed import SpeedController, metadata_cache

LENGTHS = (5, 17, 9, 30, 3)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("checkpointing", ["none", "standard"])
def test_packed_attention_matches_stock_path(model_type: str, checkpointing: str) -> None:
    model = tiny_lora_model(model_type)
    batch = packed_batch(LENGTHS)
    off = SpeedController(model, SpeedConfig(metadata_cache=False, checkpointing=checkpointing), torch.device("cpu"))
    ref_loss, ref_logits = step(model, off.model_inputs(batch), batch)
    ref_grads = grads(model)
    on = SpeedController(model, SpeedConfig(metadata_cache=True, checkpointing=checkpointing), torch.device("cpu"))
    assert on.state()["metadata_cache"] == {
        "on": True,
        "backend": "sdpa",
        "reason": on.state()["metadata_cache"]["reason"],
    }
    loss, logits = step(model, on.model_inputs(batch), batch)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert max_relative_error(grads(model), ref_grads) < 1e-5


def test_documents_do_not_see_each_other() -> None:
    """Each document's logits equal running it alone: the packed path isolates documents."""
    model = tiny_lora_model("qwen3")
    batch = packed_batch((7, 12))
    ctl = SpeedController(model, SpeedConfig(metadata_cache=True), torch.device("cpu"))
    with torch.no_grad():
        packed = model(**ctl.model_inputs(batch)).logits[0, 7:]
        alone = model(input_ids=batch.input_ids[:, 7:], use_cache=False).logits[0]
    assert torch.allclose(packed, alone, atol=1e-5)


def test_all_switches_off_gives_stock_inputs() -> None:
    model = tiny_lora_model("llama")
    batch = packed_batch(LENGTHS)
    ctl = SpeedController(model, SpeedConfig(metadata_cache=False, checkpointing="none"), torch.device("cpu"))
    inputs, stock = ctl.model_inputs(batch), stock_model_inputs(model, batch)
    assert inputs.keys() == stock.keys()
    assert all(inputs[k] is stock[k] or inputs[k] == stock[k] for k in ("use_cache",))
    assert torch.equal(inputs["input_ids"], stock["input_ids"])
    assert model.get_base_model().config._attn_implementation == "sdpa"


@pytest.mark.parametrize("window", [None, 4])
def test_block_diagonal_mask_matches_reference(window: int | None) -> None:
    batch = packed_batch(LENGTHS)
    ours = metadata_cache.block_diagonal_mask(batch.document_ids, window)
    assert torch.equal(ours, block_causal_mask(batch.document_ids, sliding_window=window))


@pytest.mark.parametrize("window", [None, 100])
def test_flex_block_lists_cover_exactly_the_dense_mask(window: int | None) -> None:
    lengths = (300, 45, 500, 129, 1, 200)
    batch = packed_batch(lengths)
    t, block = batch.num_tokens, metadata_cache.FLEX_BLOCK
    any_pair, full = metadata_cache.document_kv_blocks(batch.cu_seqlens, t, window)
    dense = block_causal_mask(batch.document_ids, sliding_window=window)[0, 0]
    nb = -(-t // block)
    padded = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    padded[:t, :t] = dense
    tiles = padded.view(nb, block, nb, block).permute(0, 2, 1, 3)
    assert torch.equal(any_pair, tiles.any(-1).any(-1))
    real = torch.zeros_like(padded)
    real[:t, :t] = True
    real_tiles = real.view(nb, block, nb, block).permute(0, 2, 1, 3)
    fully = (tiles | ~real_tiles).all(-1).all(-1)
    assert not (full & ~fully).any()  # never marks a block full that is not


def test_flex_forward_matches_sdpa_on_cpu() -> None:
    batch = packed_batch((40, 100, 150, 10))
    meta_sdpa = metadata_cache.build_metadata(batch, torch.device("cpu"), "sdpa")
    meta_flex = metadata_cache.build_metadata(batch, torch.device("cpu"), "flex")
    q = torch.randn(1, 4, batch.num_tokens, 16)
    k, v = torch.randn(1, 2, batch.num_tokens, 16), torch.randn(1, 2, batch.num_tokens, 16)
    module = torch.nn.Module()
    ref, _ = metadata_cache.packed_attention_forward(module, q, k, v, None, 0.25, packed_metadata=meta_sdpa)
    out, _ = metadata_cache.packed_attention_forward(module, q, k, v, None, 0.25, packed_metadata=meta_flex)
    assert torch.allclose(out, ref, atol=1e-5)


def test_flex_attention_is_compiled_once_for_eager_cuda_callers_and_left_to_a_compiled_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    compiled: list[Any] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or ("compiled", fn))
    monkeypatch.setattr(metadata_cache, "_COMPILED_FLEX", {})
    on_cuda = SimpleNamespace(is_cuda=True)
    assert metadata_cache._flex_attention_for(on_cuda) == ("compiled", flex_attention)
    assert metadata_cache._flex_attention_for(on_cuda) == ("compiled", flex_attention)
    assert compiled == [flex_attention]
    assert metadata_cache._flex_attention_for(torch.zeros(1)) is flex_attention
    # Inside a compiled layer the layer's own compile lowers it: no cached wrapper for Dynamo to warn about.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert metadata_cache._flex_attention_for(on_cuda) is flex_attention


def test_backend_choice_on_cpu_and_requests() -> None:
    cpu = torch.device("cpu")
    assert metadata_cache.choose_backend("auto", cpu, torch.float32).name == "sdpa"
    choice = metadata_cache.choose_backend("varlen", cpu, torch.bfloat16)
    assert choice.name == "sdpa" and "varlen requested but" in choice.reason


def test_gpt_oss_keeps_its_explicit_masks() -> None:
    model = tiny_lora_model("gpt_oss")
    ctl = SpeedController(model, SpeedConfig(metadata_cache=True), torch.device("cpu"))
    state = ctl.state()["metadata_cache"]
    assert state["on"] is False and "sinks" in state["reason"]
    assert "attention_mask" in ctl.model_inputs(packed_batch(LENGTHS))


def meta_metadata(lengths: tuple[int, ...]) -> metadata_cache.PackedAttentionMetadata:
    """Metadata on the meta device: kernels' shape functions run, no GPU needed."""
    host = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return metadata_cache.PackedAttentionMetadata(
        backend="varlen",
        cu_seqlens=host.to("meta"),
        max_seqlen=max(lengths),
        document_ids=torch.empty(sum(lengths), dtype=torch.int32, device="meta"),
        host_cu_seqlens=host,
        num_tokens=sum(lengths),
    )


@pytest.mark.parametrize("torch_params", ["2.11", "2.12"])
def test_varlen_never_repeats_grouped_kv(torch_params: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped K/V reach the flash kernel as they are, whether or not this torch's varlen_attn has enable_gqa:
    nothing saved for backward has the K/V's shape widened to all query heads, and their gradients stay grouped."""
    params = {"2.11": frozenset({"scale", "is_causal"}), "2.12": frozenset({"scale", "window_size", "enable_gqa"})}
    monkeypatch.setattr(metadata_cache, "_varlen_params", lambda: params[torch_params])
    direct: list[int] = []
    grouped = metadata_cache.grouped_flash_attention
    monkeypatch.setattr(metadata_cache, "grouped_flash_attention", lambda *a: direct.append(1) or grouped(*a))
    meta = meta_metadata((700, 1300, 2096))
    q = torch.empty(4096, 32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(4096, 8, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = metadata_cache.varlen_attention(q, k, v, meta, 0.125, None)
    out.sum().backward()
    assert out.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert direct == ([1] if torch_params == "2.11" else [])
    assert (4096, 8, 64) in saved and saved.count((4096, 32, 64)) == 2, saved  # q and the output; K/V grouped


def test_sliding_window_without_varlen_window_goes_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose varlen_attn has no window still runs a sliding window: the kernel takes it directly."""
    monkeypatch.setattr(metadata_cache, "_varlen_params", lambda: frozenset({"scale", "is_causal"}))
    calls: list[dict] = []
    real = torch.ops.aten._flash_attention_forward

    def record(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", record)
    q, k, v = (torch.empty(4096, 4, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    out = metadata_cache.varlen_attention(q, k, v, meta_metadata((4096,)), 0.125, 512)
    assert out.shape == q.shape
    assert calls == [{"scale": 0.125, "window_size_left": 511, "window_size_right": 0}]


def test_grouped_kernel_call_compiles_once_for_every_packed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled layers trace the direct kernel call (forward and its backward) with no graph break, and rows of
    other lengths and document counts reuse the graph."""
    import torch._dynamo.testing

    monkeypatch.setattr(metadata_cache, "_varlen_params", lambda: frozenset({"scale", "is_causal"}))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    attend = torch.compile(
        lambda q, k, v, meta: metadata_cache.varlen_attention(q, k, v, meta, 0.125, None),
        backend=counter,
        fullgraph=True,
        dynamic=True,
    )
    for lengths in [(700, 1300, 2096), (100, 900), (3000, 10, 2000, 5)]:
        total = sum(lengths)
        q = torch.empty(total, 32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(total, 8, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        attend(q, k, v, meta_metadata(lengths)).sum().backward()
        assert k.grad.shape == k.shape
    assert counter.frame_count == 1


@pytest.fixture
def causal(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each SDPA call from here on runs plain causal attention (True) or takes a mask (False)."""
    import torch.nn.functional as F

    calls: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(bool(kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_a_single_document_row_takes_the_plain_causal_path(causal: list[bool]) -> None:
    """One document filling the row: causal attention over the whole row, same result as the document mask; an
    explicitly requested backend and rows of several documents keep the packed path."""
    model = tiny_lora_model("qwen3")
    one, two = packed_batch((48,)), packed_batch((20, 28))
    auto = SpeedConfig(metadata_cache=True, checkpointing="none")
    ctl = SpeedController(model, auto, torch.device("cpu"))
    _, logits_whole = step(model, ctl.model_inputs(one), one)
    grads_whole = grads(model)
    assert causal and all(causal)
    causal.clear()
    ctl.apply(dataclasses.replace(auto, attention_backend="sdpa"))
    _, logits_mask = step(model, ctl.model_inputs(one), one)
    assert causal and not any(causal)
    assert torch.allclose(logits_whole, logits_mask, atol=1e-5)
    assert max_relative_error(grads_whole, grads(model)) <= 1e-4
    causal.clear()
    ctl.apply(auto)
    step(model, ctl.model_inputs(two), two)
    assert causal and not any(causal)


BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("backend", "capability", "on", "words"),
    [
        ("auto", (9, 0), True, "automatic: a one-document row runs through cuDNN"),  # H100, H200
        ("auto", (8, 9), False, "automatic: off on sm_8x"),  # RTX 40-series: not measured
        ("auto", (12, 0), False, "automatic: off on sm_12x"),  # RTX 50-series
        ("auto", (12, 1), False, "automatic: off on sm_12x"),  # GB10 (DGX Spark)
        ("cudnn", (8, 6), True, "asked for"),
        ("varlen", (9, 0), False, "every row takes the varlen kernel"),
    ],
)
def test_cudnn_attention_is_automatic_on_hopper_and_on_request_elsewhere(
    backend: str, capability: tuple[int, int], on: bool, words: str
) -> None:
    problem = metadata_cache.cudnn_problem("cuda", BF16, capability, 128, has_cudnn=True)
    got, why = metadata_cache.resolve_cudnn(backend, problem, capability)
    assert (got, why.startswith(words)) == (on, True), why


@pytest.mark.parametrize(
    ("device", "dtype", "capability", "head_dim", "has_cudnn", "words"),
    [
        ("cpu", torch.float32, None, 128, True, "needs a CUDA GPU"),
        ("cuda", torch.float32, (9, 0), 128, True, "the model is float32"),
        ("cuda", BF16, (9, 0), 128, False, "no cuDNN"),
        ("cuda", BF16, (7, 5), 128, True, "sm80 or newer"),
        ("cuda", BF16, (9, 0), 256, True, "heads of 256"),
        ("cuda", BF16, (9, 0), 100, True, "heads of 100"),
        ("cuda", torch.float16, (9, 0), 64, True, None),
    ],
)
def test_cudnn_attention_names_what_it_cannot_serve(
    device: str, dtype: torch.dtype, capability: tuple[int, int] | None, head_dim: int, has_cudnn: bool, words: str
) -> None:
    problem = metadata_cache.cudnn_problem(device, dtype, capability, head_dim, has_cudnn)
    assert problem is None if words is None else words in problem, problem
    # Even a request cannot turn it on where it cannot run.
    assert metadata_cache.resolve_cudnn("cudnn", problem, capability)[0] is (problem is None)


def test_cudnn_attention_serves_only_whole_rows_without_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel call goes to cuDNN for a one-document row only: a packed row keeps its document mask, and a row
    under attention dropout or with heads cuDNN does not take keeps SDPA."""
    calls: list[tuple[int, ...]] = []

    def cudnn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(tuple(query.shape))
        groups = query.shape[1] // key.shape[1]
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=groups > 1)

    monkeypatch.setattr(metadata_cache, "cudnn_causal_attention", cudnn)
    q = torch.randn(1, 4, 48, 16)
    k, v = torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 16)

    def attend(lengths: tuple[int, ...], cudnn_on: bool = True, dropout: float = 0.0, value: torch.Tensor = v) -> None:
        meta = metadata_cache.build_metadata(packed_batch(lengths), torch.device("cpu"), "sdpa", True, cudnn_on)
        module = SimpleNamespace(is_causal=True, training=dropout > 0)
        metadata_cache.packed_attention_forward(module, q, k, value, None, dropout=dropout, packed_metadata=meta)

    attend((48,))
    assert calls == [(1, 4, 48, 16)]
    attend((20, 28))  # two documents: the packed path
    attend((48,), cudnn_on=False)
    attend((48,), dropout=0.1)
    attend((48,), value=torch.randn(1, 2, 48, 8))  # value heads narrower than query heads
    assert len(calls) == 1


def test_cudnn_attention_reports_why_it_is_off_on_the_cpu() -> None:
    model = tiny_lora_model("llama")
    ctl = SpeedController(model, SpeedConfig(metadata_cache=True, checkpointing="none"), torch.device("cpu"))
    assert ctl.state()["cudnn_attention"] == {"on": False, "reason": "cuDNN attention needs a CUDA GPU"}
    ctl.apply(SpeedConfig(metadata_cache=False, checkpointing="none", attention_backend="cudnn"))
    assert ctl.state()["cudnn_attention"]["reason"].startswith("needs the metadata cache")
    ctl.apply(SpeedConfig(metadata_cache=True, checkpointing="none", attention_backend="flex"))
    assert ctl.state()["cudnn_attention"] == {"on": False, "reason": "every row takes the flex kernel asked for"}


def test_a_named_kernel_runs_a_one_document_row_through_the_packed_kernel(causal: list[bool]) -> None:
    """With a kernel named (varlen, sdpa, ...), a one-document row takes the packed rows' kernel, so auto against a
    named kernel compares cuDNN's (or SDPA's causal) kernel with the packed one; auto, where cuDNN is not used,
    keeps the whole-row causal path, and so does cudnn asked for where it cannot run. The results agree."""
    model = tiny_lora_model("llama")
    one = packed_batch((40,))
    auto = SpeedConfig(metadata_cache=True, checkpointing="none")
    ctl = SpeedController(model, auto, torch.device("cpu"))
    results = {}
    for name, settings in {
        "auto": auto,
        "sdpa asked for": dataclasses.replace(auto, attention_backend="sdpa"),
        "cudnn asked for": dataclasses.replace(auto, attention_backend="cudnn"),
    }.items():
        ctl.apply(settings)
        meta = ctl.model_inputs(one)[metadata_cache.METADATA_KWARG]
        causal.clear()
        _, logits = step(model, ctl.model_inputs(one), one)
        results[name] = (meta.whole_row_causal, all(causal), logits)
    assert [results[n][:2] for n in results] == [(True, True), (False, False), (True, True)]
    assert all(torch.allclose(results[n][2], results["auto"][2], atol=1e-5) for n in results)


def test_generation_with_the_packed_attention_set_matches_stock_generation() -> None:
    """Sampling during a run (GRPO's groups, the report's answers) calls the model without packed metadata, with a
    KV cache and left padding: the packed attention's fallback must attend as stock attention does, causally in
    the prompt and over the cache after it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[0, 0, 5, 9, 12, 7], [3, 8, 14, 2, 11, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    settings: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    stock = model.generate(input_ids=ids, attention_mask=mask, **settings)
    metadata_cache.register_packed_attention()
    model.set_attn_implementation(metadata_cache.ATTENTION_NAME)
    try:
        packed = model.generate(input_ids=ids, attention_mask=mask, **settings)
        single = model.generate(input_ids=ids[1:], **settings)
    finally:
        model.set_attn_implementation("sdpa")
    assert packed.tolist() == stock.tolist()
    assert single.tolist() == stock[1:].tolist()
