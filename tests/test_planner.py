"""The VRAM planner: its per-layer activation count against what autograd really saves, its batch search,
and its committed accuracy table against the measurements in benchmarks/."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.hardware.planner import (
    GIB,
    MemoryPlan,
    TrainSetup,
    choose_memory_settings,
    chunk_split,
    chunk_tokens_for,
    dequantized_experts_bytes,
    estimate_memory,
    largest_tokens,
    layer_activation_bytes,
    longest_row,
    lora_weight_copy_bytes,
    most_resident_layers,
    resident_backward_bytes,
    setup_from_speed_state,
    training_flops_per_token,
    usable_bytes,
)
from engine.hardware.shapes import BUILTIN_CONFIGS, ModelShape, load_shape

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ACCURACY_JSON = BENCHMARKS / "planner_accuracy.json"


def measured_peak(record: dict, allocated_key: str = "peak_gib") -> float:
    """A record's measured peak for the planner check: its true peak (``true_peak_gib``, or ``true_peak_bytes`` in
    planner_accuracy.json: the allocator's peak reserved memory, step graphs' pool included; engine.hardware.vram)
    where it has one. Every record committed before the true peak was recorded (all of benchmarks/ up to
    2026-12-02: planner_accuracy, speed_h200, qlora_*, qlora_train_*, long_context_*) predates it and holds only the
    allocated peak under ``allocated_key``. Many of those also hold the reserved peak (``reserved_gib``), the same
    measure as the true peak, but their check stays on the allocated one: those reserved peaks run up to 10% above
    the plan (the allocator's cached blocks and step graphs' pool, which the plan leaves to its 10% margin)."""
    true_key = "true_peak_bytes" if allocated_key.endswith("_bytes") else "true_peak_gib"
    return float(record[true_key] if true_key in record else record[allocated_key])


class _FlashLike:
    """Saves what FlashAttention-style kernels save for backward: q, k, v, out and the log-sum-exp."""

    @staticmethod
    def attention(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):  # type: ignore[no-untyped-def]
                out = torch.zeros_like(q)
                lse = torch.zeros(q.shape[:3], dtype=torch.float32)
                ctx.save_for_backward(q, k, v, out, lse)
                return out

            @staticmethod
            def backward(ctx, grad):  # type: ignore[no-untyped-def]
                q, k, v, _, _ = ctx.saved_tensors
                return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        return Fn.apply(query, key, value).transpose(1, 2).contiguous(), None


def saved_bytes_per_layer(
    model_type: str, tokens: int, lora_16bit: bool = False, chunk_scope: str | None = None
) -> tuple[int, ModelShape]:
    """Unique bytes autograd saves per decoder layer (3 layers minus 2 layers) for a tiny peft LoRA model, with
    its per-token modules (``chunk_scope`` "all") or its MLPs ("mlp") in 16-token chunks."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    from engine.speed.chunked_mlp import ChunkedModules
    from engine.speed.lora_16bit import Lora16Bit

    AttentionInterface.register("tunedeck_test_saving", _FlashLike.attention)
    raw = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "vocab_size": 128, "tie_word_embeddings": True}  # fmt: skip
    totals = []
    for layers in (2, 3):
        config = AutoConfig.for_model(model_type, num_hidden_layers=layers, **raw)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="tunedeck_test_saving"
        )
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
        Lora16Bit(model).switch(lora_16bit)
        if chunk_scope:
            ChunkedModules(model.get_base_model()).install(chunk_tokens=16, mlp_only=chunk_scope == "mlp")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen, params: set[int] = params) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        ids = torch.randint(0, 128, (1, tokens))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, position_ids=torch.arange(tokens)[None], labels=ids)
        totals.append(sum(seen.values()))
    shape = ModelShape.from_config_dict({"model_type": model_type, "num_hidden_layers": 2, **raw}, "tiny")
    return totals[1] - totals[0], shape


@pytest.mark.parametrize("lora_16bit", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_layer_activations_match_what_autograd_saves(model_type: str, lora_16bit: bool) -> None:
    """Per token (the slope over two lengths) and per layer (the 16-bit LoRA weight copies, the intercept)."""
    short, shape = saved_bytes_per_layer(model_type, tokens=64, lora_16bit=lora_16bit)
    long, _ = saved_bytes_per_layer(model_type, tokens=128, lora_16bit=lora_16bit)
    setup = TrainSetup(lora_rank=8, attention="varlen", native_gqa=False, lora_16bit=lora_16bit)
    assert layer_activation_bytes(shape, setup, "varlen") == (long - short) // 64
    assert lora_weight_copy_bytes(shape, setup) == 2 * short - long


@pytest.mark.parametrize("chunk_scope", ["all", "mlp"])
@pytest.mark.parametrize("lora_16bit", [False, True])
def test_chunked_modules_keep_what_the_planner_says(lora_16bit: bool, chunk_scope: str) -> None:
    """With per-token modules in chunks, what a layer keeps for backward over the whole row is the unchunked
    count less the chunk-local part plus the whole-row tensors chunking adds (chunk_split)."""
    short, shape = saved_bytes_per_layer("qwen3", tokens=64, lora_16bit=lora_16bit, chunk_scope=chunk_scope)
    long, _ = saved_bytes_per_layer("qwen3", tokens=128, lora_16bit=lora_16bit, chunk_scope=chunk_scope)
    setup = TrainSetup(lora_rank=8, native_gqa=False, lora_16bit=lora_16bit, chunk_scope=chunk_scope)  # type: ignore[arg-type]
    local, whole = chunk_split(shape, setup)
    assert layer_activation_bytes(shape, setup, "varlen") - local + whole == (long - short) // 64


def test_committed_accuracy_table_is_within_15_percent() -> None:
    data = json.loads(ACCURACY_JSON.read_text(encoding="utf-8"))
    cc = tuple(data["meta"]["compute_capability"])
    checked = 0
    for row in data["rows"]:
        if row.get("kind") != "accuracy" or "peak_bytes" not in row or row.get("oom"):
            continue
        # the table measured stock cross-entropy and peft's float32 LoRA path
        setup = TrainSetup(**{"fused_loss": False, "lora_16bit": False, **row["setup"]})  # type: ignore[arg-type]
        predicted = estimate_memory(load_shape(row["shape"]), setup, cc).peak  # type: ignore[arg-type]
        measured = measured_peak(row, "peak_bytes")
        error = (predicted - measured) / measured
        assert abs(error) <= 0.15, (row["shape"], row["checkpointing"], row["tokens"], f"{error:+.1%}")
        checked += 1
    assert checked >= 18


def test_committed_cap_runs_did_not_run_out_of_memory() -> None:
    data = json.loads(ACCURACY_JSON.read_text(encoding="utf-8"))
    caps = [row for row in data["rows"] if row.get("kind") == "cap" and row["fits"]]
    assert caps
    for row in caps:
        trained = [r for r in caps if (r["shape"], r["cap_gib"]) == (row["shape"], row["cap_gib"]) and not r.get("oom")]
        assert trained, (row["shape"], row["cap_gib"])
        assert not row.get("oom") or row.get("note"), "an out-of-memory run must say why it was not the planner"


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_memory_grows_with_tokens_and_checkpointing_saves(name: str) -> None:
    shape = load_shape(name)
    small, big = (estimate_memory(shape, TrainSetup(tokens=t)) for t in (2048, 8192))
    assert big.peak > small.peak > 0
    standard = estimate_memory(shape, TrainSetup(tokens=8192, checkpointing="standard"))
    offloaded = estimate_memory(shape, TrainSetup(tokens=8192, checkpointing="offloaded"))
    assert offloaded.peak <= standard.peak < big.peak


def test_qlora_weights_are_about_a_quarter() -> None:
    shape = load_shape("llama-3.1-8b")
    lora = estimate_memory(shape, TrainSetup(tokens=256, kbit_upcast=False))
    qlora = estimate_memory(shape, TrainSetup(tokens=256, qlora=True, kbit_upcast=False))
    assert 14 * GIB < lora.weights < 16 * GIB
    assert 5 * GIB < qlora.weights < 6.5 * GIB  # NF4 linears + 16-bit embeddings and head


def test_qlora_moe_counts_4bit_experts_and_one_layer_dequantized() -> None:
    shape = load_shape("qwen3-30b-a3b")
    lora = estimate_memory(shape, TrainSetup(tokens=4096, checkpointing="offloaded"))
    qlora = estimate_memory(shape, TrainSetup(tokens=4096, qlora=True, checkpointing="offloaded"))
    experts = shape.num_layers * shape.expert_params_per_layer()
    assert 53 * GIB < experts * 2 < 55 * GIB  # the 16-bit experts (58 GB)
    assert 55 * GIB < lora.weights < 58 * GIB
    assert 15 * GIB < qlora.weights < 18 * GIB  # NF4 experts and linears, 16-bit embeddings and head
    one_layer = shape.expert_params_per_layer() * 2
    assert dequantized_experts_bytes(shape, TrainSetup(tokens=4096, qlora=True)) == one_layer  # 1.1 GiB
    assert dequantized_experts_bytes(shape, TrainSetup(tokens=4096)) == 0
    dense = load_shape("llama-3.1-8b")
    assert dequantized_experts_bytes(dense, TrainSetup(tokens=4096, qlora=True)) == 0
    assert qlora.recompute >= one_layer and qlora.peak < 24 * GIB


def test_qlora_keeps_the_compute_dtype_unless_peft_upcasts() -> None:
    shape = load_shape("llama-3.1-8b")
    ours = TrainSetup(tokens=256, qlora=True, checkpointing="offloaded")
    upcast = TrainSetup(tokens=256, qlora=True, checkpointing="offloaded", kbit_upcast=True)
    assert ours.activation_bytes == 2 and upcast.activation_bytes == 4
    # peft's float32 upcast measured 9.3 GiB here (benchmarks/planner_accuracy.md); the 16-bit base fits 8 GiB
    assert estimate_memory(shape, ours).peak < 7 * GIB < 8 * GIB < estimate_memory(shape, upcast).peak
    assert estimate_memory(shape, ours).attention == "varlen"  # 16-bit activations: the varlen kernel runs


def test_largest_tokens_is_the_boundary() -> None:
    shape = load_shape("qwen3-0.6b")
    budget = 8 * GIB
    setup = TrainSetup(checkpointing="standard")
    tokens = largest_tokens(shape, setup, budget, max_tokens=65536)
    assert tokens is not None and tokens % 256 == 0
    assert estimate_memory(shape, setup.with_tokens(tokens)).peak * 1.1 <= budget
    assert estimate_memory(shape, setup.with_tokens(tokens + 256)).peak * 1.1 > budget
    assert largest_tokens(shape, setup, 1 * GIB) is None


def test_choose_prefers_no_recompute_when_it_fits() -> None:
    shape = load_shape("qwen3-0.6b")
    plan = choose_memory_settings(shape, usable_bytes(80 * GIB))
    assert plan.fits and plan.checkpointing == "none" and plan.qlora is False
    small = choose_memory_settings(shape, usable_bytes(12 * GIB))
    assert small.fits and small.checkpointing in ("standard", "offloaded")
    assert "tokens" in small.reasons["tokens_per_batch"]


def test_choose_reports_what_would_fit() -> None:
    plan = choose_memory_settings(load_shape("llama-3.1-8b"), usable_bytes(8 * GIB), min_tokens=8192)
    assert not plan.fits and plan.largest_possible_tokens and "max_seq_len" in plan.reasons["fit"]
    longer = choose_memory_settings(
        load_shape("llama-3.1-8b"),
        usable_bytes(12 * GIB),
        base=TrainSetup(chunk_tokens=1024, chunk_scope="mlp"),
        min_tokens=49152,
    )
    assert not longer.fits and longer.estimate.peak * 1.1 > longer.budget_bytes  # the estimate is for 49,152
    assert longer.largest_possible_tokens is not None and 32768 < longer.largest_possible_tokens < 49152
    assert f"up to {longer.largest_possible_tokens:,} tokens" in longer.reasons["fit"]


def test_integrated_memory_leaves_room_for_the_system() -> None:
    assert usable_bytes(128 * GIB, integrated=True) < usable_bytes(128 * GIB)


def test_load_shape_sources(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(BUILTIN_CONFIGS["llama-3.2-1b"]), encoding="utf-8")
    from_folder = load_shape(str(folder))
    assert from_folder.name == "my-model" and from_folder.num_layers == 16 and from_folder.tied_embeddings
    assert load_shape(str(folder / "config.json")).hidden_size == 2048
    assert load_shape("Qwen/Qwen3-0.6B").qk_norm
    assert load_shape("meta-llama/Llama-3.1-8B-Instruct").vocab_size == 128256
    moe = load_shape("qwen3-30b-a3b")
    assert moe.is_moe and moe.total_params() > 29e9 and moe.active_params_per_token() < 4e9
    with pytest.raises(ConfigError):
        load_shape("no-such-model-xyz")


def setup_from_state(state: dict, shape: ModelShape, tokens: int, **fixed: object) -> TrainSetup:
    """The committed tables were measured with K/V repeated to every query head (torch 2.11, before they went to
    the kernel grouped)."""
    return setup_from_speed_state(state, shape, tokens, native_gqa=False, **fixed)


def phase_peak(probe: dict) -> float:
    return max(measured_peak(phase) for step in probe["steps"] for phase in step.values() if isinstance(phase, dict))


@pytest.mark.parametrize(
    ("report", "least"),
    [
        ("history/long_context_h200.json", 5),
        ("history/long_context_h200_16gib.json", 1),
        ("history/long_context_h200_24gib.json", 1),
        ("long_context_final_h200.json", 3),
    ],
)
def test_long_context_peaks_are_predicted_within_10_percent_above(report: str, least: int) -> None:
    """The 8B QLoRA long-context probes (per-token modules in chunks, offloaded checkpointing; eager layers under
    8 GiB, compiled ones in the 16 and 24 GiB re-measurements, every switch in its final state in the last): every
    row that trained peaked at or below the prediction, by at most 10%, and every row that ran out was predicted over
    its cap."""
    data = json.loads((BENCHMARKS / report).read_text(encoding="utf-8"))
    shape = load_shape("llama-3.1-8b")
    checked = 0
    for search in data["searches"]:
        if "measured_with" in search:  # an earlier version's switches, not the current chunking
            continue
        state = next(probe["state"] for probe in search["probes"] if probe["ok"])  # one set of switches per search
        for probe in search["probes"]:
            setup = setup_from_state(state, shape, probe["tokens"], qlora=True, lora_rank=32)
            predicted = estimate_memory(shape, setup).peak / GIB
            if probe["ok"]:
                measured = phase_peak(probe)
                assert measured <= predicted <= 1.10 * measured, (probe["tokens"], measured, predicted)
            else:
                assert predicted > probe["cap_gib"], (probe["tokens"], predicted)
            checked += 1
    assert checked >= least


def test_long_rows_with_compiled_layers_are_predicted_within_10_percent_above() -> None:
    """Three lengths of 8B QLoRA with compiled layers under a 24 GiB cap, where the peak falls in an attention
    block's backward, and one 8,192-token document in chunks under 8 GiB (benchmarks/qlora_memory_peak_h200.md);
    the planner before counted that block's backward on top of the whole layer's tensors and was 3-13% over."""
    data = json.loads((BENCHMARKS / "qlora_memory_peak_h200.json").read_text(encoding="utf-8"))
    shape = load_shape("llama-3.1-8b")
    assert data["state"]["fused_kernels"]["on"] and len(data["rows"]) == 4
    for row in data["rows"]:
        setup = setup_from_speed_state(data["state"], shape, row["tokens"], qlora=True, lora_rank=32)
        predicted = estimate_memory(shape, setup).peak / GIB
        measured = row["measured_peak_gib"]
        assert measured <= predicted <= 1.10 * measured, (row["tokens"], measured, predicted)


def test_offloaded_speed_rows_are_predicted_within_10_percent_above() -> None:
    """The H200 speed benchmark's offloaded rows, with and without the MLPs in chunks (compiled layers)."""
    data = json.loads((BENCHMARKS / "speed_h200.json").read_text(encoding="utf-8"))
    rows = [row for row in data["dense"] if row.get("state", {}).get("checkpointing", {}).get("mode") == "offloaded"]
    assert {row["state"]["chunked_mlp"]["on"] for row in rows} == {False, True} and len(rows) >= 4
    for row in rows:
        shape = load_shape(row["model"])
        predicted = estimate_memory(shape, setup_from_state(row["state"], shape, row["tokens"])).peak / GIB
        measured = measured_peak(row, "peak_vram_gib")
        assert measured <= predicted <= 1.10 * measured, (row["model"], row["variant"], measured, predicted)


def test_chunking_applies_to_long_rows_and_keeps_the_mlp_to_one_chunk() -> None:
    shape = load_shape("llama-3.1-8b")
    assert chunk_tokens_for(shape.intermediate_size, shape.hidden_size) == 1024 and chunk_tokens_for(0, 0) is None

    def peak(setup: TrainSetup, model: ModelShape = shape) -> int:
        return estimate_memory(model, setup).peak

    whole = TrainSetup(tokens=32768, qlora=True, checkpointing="offloaded")
    small, large = replace(whole, chunk_tokens=1024), replace(whole, chunk_tokens=4096)
    assert peak(small) < peak(large) < peak(whole)
    automatic = replace(small, chunk_min_tokens=8192)
    assert peak(automatic) == peak(small)
    assert peak(automatic.with_tokens(8192)) == peak(whole.with_tokens(8192))  # short rows are not chunked
    assert peak(replace(automatic, checkpointing="none")) == peak(replace(whole, checkpointing="none"))
    moe = load_shape("qwen3-30b-a3b")  # expert layers are never chunked
    assert peak(replace(whole, chunk_tokens=1024), moe) == peak(whole, moe)


def test_the_plan_counts_on_chunks_on_a_gpu_unless_they_are_switched_off() -> None:
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget, build_profile

    card = DeviceTarget.from_spec(gpus.find_gpu("NVIDIA GeForce RTX 4070"), vram_gib=12)  # type: ignore[arg-type]
    shape = load_shape("llama-3.1-8b")
    chunked = build_profile(card, shape, max_tokens=65536).memory_plan
    whole = build_profile(card, shape, max_tokens=65536, overrides={"chunked_mlp": False}).memory_plan
    assert chunked is not None and whole is not None and chunked.fits and whole.fits
    assert chunked.tokens > 2 * whole.tokens > 8192
    assert "MLPs in chunks of 1,024 tokens" in chunked.reasons["tokens_per_batch"]
    assert "chunks" not in whole.reasons["tokens_per_batch"]


def test_the_plan_names_the_longest_row_that_trains() -> None:
    shape, budget = load_shape("llama-3.1-8b"), usable_bytes(12 * GIB)
    chunked = choose_memory_settings(shape, budget, base=TrainSetup(chunk_tokens=1024, chunk_min_tokens=8192))
    whole = choose_memory_settings(shape, budget)
    for plan in (chunked, whole):
        assert plan.longest_tokens is not None and plan.tokens is not None and plan.longest_tokens >= plan.tokens
    assert chunked.longest_tokens > 2 * whole.longest_tokens  # type: ignore[operator]
    longest = chunked.longest_tokens
    setup = TrainSetup(tokens=longest, qlora=True, checkpointing="offloaded", chunk_tokens=1024, chunk_min_tokens=8192)
    assert estimate_memory(shape, setup).peak * 1.1 <= budget  # it fits, and 256 more would not
    assert estimate_memory(shape, setup.with_tokens(longest + 256)).peak * 1.1 > budget
    how = "with QLoRA and offloaded checkpointing, the MLPs in chunks of 1,024 tokens"
    assert chunked.reasons["longest"] == f"{longest:,} tokens, {how}"
    assert "chunks" not in whole.reasons["longest"]


def qlora_row_plan(model: str, row: dict) -> tuple[ModelShape, TrainSetup, float]:
    """A measured r32 QLoRA row's shape, the setup its recorded switches plan for, and the predicted peak in GiB."""
    shape = load_shape(model)
    setup = setup_from_speed_state(row["state"], shape, row["tokens"], qlora=True, lora_rank=32)
    return shape, setup, estimate_memory(shape, setup).peak / GIB


@pytest.mark.parametrize(
    ("report", "least_rows", "dequant_once"),
    [
        ("qlora_h200.json", 10, {False, True}),
        ("history/qlora_fp8_h200.json", 4, {True}),
        ("qlora_step_readout_h200.json", 4, {True}),
        ("history/qlora_rerun_h200.json", 1, {True}),
    ],
)
def test_qlora_bench_rows_are_predicted_within_10_percent_above(
    report: str, least_rows: int, dequant_once: set[bool]
) -> None:
    """Every TuneDeck row of the H200 QLoRA benchmarks (Llama-3.1-8B and Qwen3-8B, 4,096 and 16,384 tokens, 8 and
    24 GiB caps, each switch off in turn, fp8 base products on) peaked at or below the planner's prediction, by at
    most 10%."""
    data = json.loads((BENCHMARKS / report).read_text(encoding="utf-8"))
    rows = [row for record in data["models"] for row in record["rows"] if row["ok"] and row["variant"] != "stock"]
    # step graphs keep a memory pool the planner does not count (their allocated peak is lower, reserved higher)
    rows = [row for row in rows if not row["state"].get("step_graphs", {}).get("on")]
    # kept attention (its attention tensors in host memory) measured no faster and went: the planner no longer has it
    rows = [row for row in rows if not row["state"].get("keep_attention", {}).get("on")]
    assert len(rows) >= least_rows and {row["state"]["dequant_once"]["on"] for row in rows} == dequant_once
    for row in rows:
        _, _, predicted = qlora_row_plan(row["model"], row)
        measured = measured_peak(row)
        assert measured <= predicted <= 1.10 * measured, (
            row["model"],
            row["variant"],
            row["tokens"],
            measured,
            predicted,
        )


BELOW = 0.99
"""The resident-layer rows' predictions may fall 1% below the measured peak (one of eleven does, by 0.01 GiB)."""


def test_resident_layer_rows_are_predicted_within_10_percent() -> None:
    """Llama-3.1-8B QLoRA rows with 12, 19 and 20 layers resident under a 24 GiB cap (step graphs off, so the
    allocator's peak is the whole step's; benchmarks/qlora_resident_h200.md): each resident layer adds its
    compiled activations to the checkpointed peak, but those above the top recomputing layer are freed before it
    recomputes (-0.1%, +3.9% and +0.9%)."""
    data = json.loads((BENCHMARKS / "qlora_resident_h200.json").read_text(encoding="utf-8"))
    rows = [row for record in data["models"] for row in record["rows"] if row["ok"]]
    rows = [row for row in rows if row["state"]["resident_layers"]["on"] and not row["state"]["step_graphs"]["on"]]
    assert sorted(row["state"]["resident_layers"]["layers"] for row in rows) == [12, 19, 20]
    for row in rows:
        _, _, predicted = qlora_row_plan(row["model"], row)
        assert BELOW * measured_peak(row) <= predicted <= 1.10 * measured_peak(row), (row["variant"], predicted)


def test_tunedeck_train_rows_without_step_graphs_are_predicted_within_10_percent() -> None:
    """`tunedeck train --qlora` itself on the H200 (benchmarks/history/qlora_train_h200.md), the rows whose allocator
    peak is the whole step's (step graphs off): Llama-3.1-8B at 4,096 tokens with 6 resident layers under 12 GiB
    (+0.3%), and at 16,384 tokens with 4 under 24 GiB (+1.0%; +12.8% when the plan still counted the top resident
    layer alive while the layer below it recomputes, where backward has already freed it)."""
    data = json.loads((BENCHMARKS / "history" / "qlora_train_h200.json").read_text(encoding="utf-8"))
    rows = [row for row in data["runs"] if not row["state"]["step_graphs"]["on"]]
    assert sorted((row["tokens"], row["resident_layers"]) for row in rows) == [(4096, 6), (16384, 4)]
    for row in rows:
        _, _, predicted = qlora_row_plan(row["shape"], row)
        assert BELOW * measured_peak(row) <= predicted <= 1.10 * measured_peak(row), (row["tokens"], predicted)


def test_tunedeck_train_rows_with_the_top_layer_freed_are_predicted_within_10_percent() -> None:
    """`tunedeck train --qlora` with the automatic resident-layer counts of this planner (one more than before on
    every row that keeps any; benchmarks/qlora_train_top_layer_h200.md): every run's peak, step graphs on or off,
    from +0.2% to +5.9%. The 8 GiB Llama-3.1-8B row keeps its top layer resident at the peak it had without."""
    data = json.loads((BENCHMARKS / "qlora_train_top_layer_h200.json").read_text(encoding="utf-8"))
    counts = sorted((row["shape"], row["cap_gib"], row["tokens"], row["resident_layers"]) for row in data["runs"])
    assert ("llama-3.1-8b", 8.0, 4096, 1) in counts and ("llama-3.1-8b", 24.0, 16384, 5) in counts
    for row in data["runs"]:
        shape, setup, predicted = qlora_row_plan(row["shape"], row)
        measured = measured_peak(row)
        assert BELOW * measured <= predicted <= 1.10 * measured, (row["shape"], row["cap_gib"], predicted)
        checkpointed = replace(setup, resident_layers=0)
        planned = most_resident_layers(shape, checkpointed, int(row["cap_gib"] * GIB))
        if (row["shape"], row["cap_gib"]) != ("qwen3-8b", 8.0):
            assert planned == row["resident_layers"]
            continue
        # its checkpointed peak is within the cap but not the margin; the top layer, which leaves the peak where
        # it is, became resident after this run
        assert row["resident_layers"] == 0 and planned == 1
        with_top = estimate_memory(shape, replace(setup, resident_layers=1)).peak
        assert with_top == estimate_memory(shape, checkpointed).peak


@pytest.mark.parametrize("report", ["qlora_train_qwen3_8gib_h200.json", "history/qlora_train_cudnn_h200.json"])
def test_later_tunedeck_train_rows_are_predicted_within_10_percent_with_the_count_the_plan_picks(report: str) -> None:
    """Later `tunedeck train --qlora` runs on the H200: Qwen3-8B under 8 GiB with its top layer resident (7.32 GiB,
    the peak it had with none), and Llama-3.1-8B under 8 and 24 GiB with one-document rows on cuDNN's attention
    kernel (benchmarks/qlora_train_qwen3_8gib_h200.md, history/qlora_train_cudnn_h200.md)."""
    data = json.loads((BENCHMARKS / report).read_text(encoding="utf-8"))
    assert data["runs"]
    for row in data["runs"]:
        shape, setup, predicted = qlora_row_plan(row["shape"], row)
        measured = measured_peak(row)
        assert BELOW * measured <= predicted <= 1.10 * measured, (row["shape"], row["cap_gib"], predicted)
        checkpointed = replace(setup, resident_layers=0)
        assert most_resident_layers(shape, checkpointed, int(row["cap_gib"] * GIB)) == row["resident_layers"]


def test_4bit_moe_rows_are_predicted_within_10_percent() -> None:
    """Qwen3-30B-A3B QLoRA on the H200 (benchmarks/qlora_moe_resident_h200.md): 4-bit experts keep only their input
    and the routing. The row without step graphs peaks at or below the plan, by at most 10% (+4.7%); the rows with
    step graphs hide their pool from the allocated peak, so their plan is held against the reserved memory, an
    upper bound of the peak (0 / 8 / 16 / 24 resident layers, and nothing checkpointed under 40 GiB: -1.4% to
    +3.5%). The plan for the 24 GiB cap keeps more layers resident than the run's old plan (8), and no more than
    the measured 24 that fit."""
    data = json.loads((BENCHMARKS / "qlora_moe_resident_h200.json").read_text(encoding="utf-8"))
    rows = [row for record in data["models"] for row in record["rows"] if row["model"] == "qwen3-30b-a3b"]
    eager = [row for row in rows if not row["state"]["step_graphs"]["on"]]
    assert len(eager) == 1 and eager[0]["state"]["checkpointing"]["mode"] == "none"
    _, _, predicted = qlora_row_plan("qwen3-30b-a3b", eager[0])
    assert measured_peak(eager[0]) <= predicted <= 1.10 * measured_peak(eager[0]), predicted
    graphed = [row for row in rows if row["state"]["step_graphs"]["on"]]
    assert {row["state"]["resident_layers"]["layers"] for row in graphed} == {0, 8, 16, 24}
    for row in graphed:
        _, _, predicted = qlora_row_plan("qwen3-30b-a3b", row)
        assert 0.95 * row["reserved_gib"] <= predicted <= 1.10 * row["reserved_gib"], (row["variant"], predicted)
    shape, setup, _ = qlora_row_plan("qwen3-30b-a3b", next(row for row in graphed if row["cap_gib"] == 24))
    planned = most_resident_layers(shape, replace(setup, resident_layers=0), 24 * GIB)
    assert 8 < planned < 24


def test_the_planned_4bit_moe_row_peaks_within_its_plan() -> None:
    """Qwen3-30B-A3B QLoRA under 24 GiB with the resident layers this planner chooses (15 of 48,
    benchmarks/qlora_moe_planned_h200.md): run eagerly it peaked at 21.39 GiB against 21.77 planned; with step graphs
    its reserved memory was the plan's. The plan for that cap is the count the run used."""
    data = json.loads((BENCHMARKS / "qlora_moe_planned_h200.json").read_text(encoding="utf-8"))
    rows = {row["variant"]: row for record in data["models"] for row in record["rows"]}
    eager, graphed = rows["auto-step_graphs"], rows["auto"]
    for row in (eager, graphed):
        assert row["state"]["resident_layers"]["layers"] == 15
    _, _, predicted = qlora_row_plan("qwen3-30b-a3b", eager)
    assert measured_peak(eager) <= predicted <= 1.10 * measured_peak(eager), predicted
    shape, setup, predicted = qlora_row_plan("qwen3-30b-a3b", graphed)
    assert 0.95 * graphed["reserved_gib"] <= predicted <= 1.10 * graphed["reserved_gib"], predicted
    assert most_resident_layers(shape, replace(setup, resident_layers=0), 24 * GIB) == 15


def test_the_plan_spends_spare_memory_on_resident_layers() -> None:
    """A 24 GiB card's plan for a 4,096-token 8B QLoRA row keeps as many layers' activations as fit with the margin
    and says so; the plan's peak stays what the batch needs; an 8 GiB card has none to spare."""
    shape = load_shape("llama-3.1-8b")
    base = TrainSetup(lora_rank=32, chunk_scope="mlp")

    def plan(gib: int) -> MemoryPlan:
        return choose_memory_settings(
            shape, usable_bytes(gib * GIB), base=base, qlora=True, min_tokens=4096, preferred_tokens=4096,
            max_tokens=4096,
        )  # fmt: skip

    roomy, tight = plan(24), plan(8)
    assert roomy.checkpointing == "offloaded" and 15 < roomy.resident_layers < 32
    assert roomy.reasons["resident_layers"].startswith(f"{roomy.resident_layers} of 32 layers keep their activations")
    checkpointed = estimate_memory(shape, replace(base, qlora=True, tokens=4096, checkpointing="offloaded"))
    assert roomy.estimate.peak == checkpointed.peak  # the plan's peak is what the batch needs
    with_resident = estimate_memory(shape, replace(base, qlora=True, tokens=4096, checkpointing="offloaded",
                                                   resident_layers=roomy.resident_layers))  # fmt: skip
    assert with_resident.peak * 1.1 <= usable_bytes(24 * GIB) < estimate_memory(
        shape, replace(base, qlora=True, tokens=4096, checkpointing="offloaded",
                       resident_layers=roomy.resident_layers + 1)).peak * 1.1  # fmt: skip
    assert f"~{with_resident.gib():.1f} GiB in all" in roomy.reasons["resident_layers"]
    assert tight.resident_layers == 0 and "resident_layers" not in tight.reasons
    # resident layers spend only what the batch leaves: the longest row the card trains keeps none
    longest = longest_row(shape, replace(base, qlora=True), usable_bytes(24 * GIB), can_offload=True,
                          compute_capability=(9, 0))  # fmt: skip
    assert roomy.longest_tokens == longest and longest > 8 * 4096


def test_no_layer_is_resident_without_checkpointing_or_where_the_mlps_run_in_chunks() -> None:
    shape = load_shape("llama-3.1-8b")
    setup = TrainSetup(tokens=4096, qlora=True, lora_rank=32, checkpointing="offloaded")
    assert most_resident_layers(shape, setup, 24 * GIB) > 0
    assert most_resident_layers(shape, setup, 10**15) == 32
    assert most_resident_layers(shape, replace(setup, checkpointing="none"), 24 * GIB) == 0
    chunked = replace(setup, tokens=32768, chunk_tokens=1024)
    assert most_resident_layers(shape, chunked, 10**15) == 0


def test_resident_layers_take_their_recompute_out_of_the_speed_estimate() -> None:
    shape = load_shape("llama-3.1-8b")
    setup = TrainSetup(tokens=4096, qlora=True, checkpointing="offloaded")
    recomputed = training_flops_per_token(shape, setup)
    half = training_flops_per_token(shape, replace(setup, resident_layers=16))
    everything = training_flops_per_token(shape, replace(setup, resident_layers=32))
    assert everything == training_flops_per_token(shape, replace(setup, checkpointing="none"))
    assert everything < half < recomputed and half == pytest.approx((everything + recomputed) / 2)


def test_the_top_resident_layers_backward_counts_what_it_decodes() -> None:
    """A dense 4-bit layer decodes up to its own 16-bit weights for the input gradients; an MoE layer its experts."""
    dense, moe = load_shape("llama-3.1-8b"), load_shape("qwen3-30b-a3b")
    setup = TrainSetup(tokens=4096, qlora=True, lora_rank=32, checkpointing="offloaded", chunk_scope="mlp")
    per_token = 1000
    layer_16bit = 2 * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336)
    recomputed_activation = 2 * 14336 * 4096
    assert resident_backward_bytes(dense, setup, per_token) == per_token * 4096 + recomputed_activation + layer_16bit
    experts = dequantized_experts_bytes(moe, setup)
    assert experts > 0 and resident_backward_bytes(moe, setup, per_token) == per_token * 4096 + experts
    assert resident_backward_bytes(dense, replace(setup, qlora=False), per_token) == per_token * 4096 + 2 * 14336 * 4096
