"""DDP vs FSDP2 choice for several GPUs: table-driven over models, card sizes and requests."""

from __future__ import annotations

import pytest

from engine.config import RunConfig
from engine.hardware.parallel import choose_for_run, choose_parallel, fsdp_peak
from engine.hardware.planner import GIB, TrainSetup, estimate_memory
from engine.hardware.shapes import load_shape

OFFLOADED = TrainSetup(tokens=4096, checkpointing="offloaded")
SHORT = TrainSetup(tokens=2048, checkpointing="offloaded")


@pytest.mark.parametrize(
    ("model", "setup", "gpus", "gib", "mode", "fits"),
    [
        ("llama-3.2-1b", OFFLOADED, 1, 24, "single", True),
        ("llama-3.2-1b", OFFLOADED, 2, 24, "ddp", True),  # two RTX 3090s
        ("llama-3.1-8b", SHORT, 2, 16, "fsdp", True),  # 15 GiB of bf16 weights: shard them
        ("llama-3.1-8b", TrainSetup(tokens=4096, qlora=True, checkpointing="offloaded"), 2, 16, "ddp", True),
        ("llama-3.1-8b", TrainSetup(tokens=4096, qlora=True, checkpointing="offloaded"), 2, 4, "ddp", False),
        ("llama-3.1-8b", OFFLOADED, 2, 6, "fsdp", False),
    ],
)
def test_auto_choice(model: str, setup: TrainSetup, gpus: int, gib: int, mode: str, fits: bool) -> None:
    plan = choose_parallel(load_shape(model), setup, gpus, gib * GIB)
    assert (plan.mode, plan.fits) == (mode, fits), plan.reason
    assert plan.reason


def test_fsdp_holds_a_share_of_the_weights_plus_gathered_layers() -> None:
    shape = load_shape("llama-3.1-8b")
    single = estimate_memory(shape, OFFLOADED)
    two, four = fsdp_peak(shape, OFFLOADED, 2, (9, 0)), fsdp_peak(shape, OFFLOADED, 4, (9, 0))
    assert four < two < single.peak
    assert single.peak - two > 0.45 * single.weights  # about half the weights leave each card


def test_requests_are_honoured_except_fsdp_with_4bit() -> None:
    shape = load_shape("llama-3.2-1b")
    assert choose_parallel(shape, OFFLOADED, 2, 24 * GIB, requested="fsdp").mode == "fsdp"
    assert choose_parallel(shape, OFFLOADED, 2, 24 * GIB, requested="ddp").mode == "ddp"
    qlora = choose_parallel(shape, TrainSetup(qlora=True), 2, 24 * GIB, requested="fsdp")
    assert qlora.mode == "ddp" and "cannot be sharded" in qlora.reason


def test_unknown_model_falls_back_to_ddp(tmp_path: object) -> None:
    config = RunConfig.from_dict({"model": {"name": "someone/unknown-model"}})
    plan = choose_for_run(config, 2, 24 * GIB)
    assert plan.mode == "ddp" and "unknown" in plan.reason and plan.peak_bytes_per_gpu is None


def test_run_config_is_read_per_gpu() -> None:
    config = RunConfig.from_dict({"model": {"name": "llama-3.1-8b"}, "data": {"tokens_per_batch": 2048}})
    assert choose_for_run(config, 2, 16 * GIB).mode == "fsdp"
    assert choose_for_run(config, 1, 16 * GIB).mode == "single"


def test_automatic_checkpointing_is_sized_as_its_leanest_mode_where_it_can_run() -> None:
    """Whether a card holds the run decides DDP or FSDP2: automatic checkpointing counts as offloaded, or as standard
    recompute on a GPU that cannot offload (an integrated-memory GPU such as GB10)."""
    from engine.hardware.parallel import setup_for_run

    config = RunConfig.from_dict({"model": {"name": "llama-3.2-1b"}, "speed": {"checkpointing": "auto"}})
    assert setup_for_run(config).checkpointing == "offloaded"
    assert setup_for_run(config, can_offload=False).checkpointing == "standard"
    explicit = RunConfig.from_dict({"model": {"name": "llama-3.2-1b"}, "speed": {"checkpointing": "none"}})
    assert setup_for_run(explicit, can_offload=False).checkpointing == "none"
    offloaded = choose_for_run(config, 2, 3 * GIB)
    standard = choose_for_run(config, 2, 3 * GIB, can_offload=False)
    assert offloaded.peak_bytes_per_gpu is not None and standard.peak_bytes_per_gpu is not None
    assert standard.peak_bytes_per_gpu > offloaded.peak_bytes_per_gpu  # layer inputs stay on the card
