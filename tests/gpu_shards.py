"""The GPU tests (the ``gpu`` marker) in shards, each short enough for one call on the GPU machine (at most 10
minutes a call; each shard is meant to take under 7).

An entry is a test file (its gpu-marked tests) or a test function (all its parameters). ``scripts/gpu_tests.sh N``
runs shard N; ``python3 tests/gpu_shards.py N`` prints its entries, one a line (``all``: every shard's, ``list``:
the table). ``tests/test_gpu_shards.py`` checks that every gpu-marked test is in exactly one shard: a new GPU test
goes into the lightest shard here.
"""

from __future__ import annotations

import sys

SPEED = "tests/test_speed_gpu.py::"

SHARDS: dict[str, tuple[str, ...]] = {
    # kernels and attention paths against the reference, checkpointing paths, routing
    "1": tuple(
        SPEED + name
        for name in (
            "test_packed_backends_match_stock_path",
            "test_sliding_window_varlen_matches_mask",
            "test_offloaded_gradients_equal_standard_on_gpu",
            "test_training_step_with_everything_on_makes_no_sync",
            "test_moe_routing_matches_eager_on_gpu",
            "test_varlen_is_the_automatic_backend_here",
            "test_lora_16bit_stays_within_the_float32_paths_bf16_noise_on_gpu",
            "test_compiled_loss_kernel_matches_the_eager_reference_on_gpu",
            "test_triton_loss_kernel_matches_the_reference_at_a_llama_vocabulary_on_gpu",
            "test_cudnn_attention_is_as_close_to_float32_as_flash_attention_on_gpu",
            "test_cudnn_attention_trains_one_document_rows_within_bf16_noise_on_gpu",
            "test_lora_groups_train_within_bf16_noise_on_gpu",
            "test_grouped_flash_attention_matches_repeated_kv_on_gpu",
        )
    ),
    # 4-bit weights, fp8 products, resident layers; DPO against TRL with the switches on
    "2": (
        *(
            SPEED + name
            for name in (
                "test_4bit_weights_reach_e4m3_in_one_pass_with_the_two_pass_bits_on_gpu",
                "test_both_triton_kernels_run_on_their_tensors_gpu_while_another_is_current",
                "test_fp8_base_products_on_tensor_cores_follow_bf16_with_no_sync",
                "test_fp8_weights_from_4bit_codes_in_one_pass_train_as_the_two_pass_weights_on_gpu",
                "test_fp8_only_in_the_recompute_keeps_the_16bit_forward_on_gpu",
                "test_automatic_fp8_keeps_a_qlora_step_16bit_forward_on_gpu",
                "test_automatic_resident_layers_size_from_gpu_memory_and_follow_the_recompute",
            )
        ),
        "tests/test_dpo_gpu.py",
    ),
    # step graphs, whole training runs, compiled regions, detection, several GPUs
    "3": (
        *(
            SPEED + name
            for name in (
                "test_step_graphs_train_as_eager_steps_with_no_sync",
                "test_dropped_step_graphs_leave_nothing_allocated_in_their_pools",
                "test_a_micro_batch_whose_capture_runs_short_runs_eagerly_with_the_captures_memory_back",
                "test_a_failed_capture_gives_its_memory_back_and_the_stream_too",
                "test_dropping_graphs_while_a_replay_is_queued_waits_for_it",
            )
        ),
        "tests/test_reliability_gpu.py",
        "tests/test_step_readout_gpu.py",
        "tests/test_fused_kernels.py",
        "tests/test_hardware_detect.py",
        "tests/test_distributed.py",
    ),
}


def covers(entry: str, node_id: str) -> bool:
    """Whether a shard entry (a file, or a file's test function) selects the collected test ``node_id``."""
    return node_id == entry or node_id.startswith(entry + ("::" if "::" not in entry else "["))


def shards_of(node_id: str) -> list[str]:
    """The shards whose entries select ``node_id`` (exactly one, for every gpu-marked test)."""
    return [name for name, entries in SHARDS.items() if any(covers(entry, node_id) for entry in entries)]


def entries(shard: str) -> tuple[str, ...]:
    """Shard ``shard``'s entries, or every shard's for ``all``."""
    if shard == "all":
        return tuple(entry for name in SHARDS for entry in SHARDS[name])
    if shard not in SHARDS:
        raise SystemExit(f"no shard {shard!r}: one of {', '.join(SHARDS)}, all or list")
    return SHARDS[shard]


def main(argv: list[str]) -> None:
    shard = argv[0] if argv else "list"
    if shard == "list":
        for name, selected in SHARDS.items():
            print(f"shard {name} ({len(selected)} entries)")
            print("".join(f"  {entry}\n" for entry in selected), end="")
        return
    print("\n".join(entries(shard)))


if __name__ == "__main__":
    main(sys.argv[1:])
