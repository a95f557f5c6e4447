"""``tunedeck detect`` and ``tunedeck plan``: what this machine is and what TuneDeck would run on it.

Heavy modules (torch, pynvml) are imported only when a command runs, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from engine.config import setting_flag
from engine.errors import TuneDeckError
from engine.hardware import checkpoint_choice

GIB = 1 << 30


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f} GiB"


def _hardware_lines(hardware: Any) -> list[str]:
    lines = []
    for gpu in hardware.gpus:
        cc = gpu.compute_capability
        sm = f"sm_{cc[0]}{cc[1]}" if cc else "sm_?"
        memory = f"{_gib(gpu.used_memory_bytes)} used of {_gib(gpu.total_memory_bytes)}"
        kind = "unified memory" if gpu.integrated else "dedicated memory"
        lines.append(
            f"GPU {gpu.index}: {gpu.name} ({gpu.architecture}, {sm}, {gpu.sm_count or '?'} SMs) - {memory}, {kind}"
        )
        lines.append(f"  class: {gpu.gpu_class}{'' if gpu.usable_by_torch else ' (not usable by this torch)'}")
        live = []
        if gpu.temperature_c is not None:
            live.append(f"{gpu.temperature_c:.0f} °C")
        if gpu.power_w is not None:
            live.append(f"{gpu.power_w:.0f} W of {gpu.power_limit_w or 0:.0f} W")
        if gpu.sm_clock_mhz is not None:
            live.append(f"SM {gpu.sm_clock_mhz} MHz (max {gpu.max_sm_clock_mhz or '?'})")
        if gpu.throttle_reasons:
            live.append("clock limits: " + ", ".join(gpu.throttle_reasons))
        if live:
            lines.append("  now: " + ", ".join(live))
    if not hardware.gpus:
        lines.append("GPU: none - CPU path")
    lines.append(
        f"driver {hardware.driver_version or '-'} (CUDA {hardware.cuda_driver_version or '-'}), "
        f"torch {hardware.torch_version or '-'} (CUDA build {hardware.torch_cuda_version or 'none'}), "
        f"{hardware.platform}{' (WSL)' if hardware.wsl else ''}, {hardware.cpu_count} CPU cores, "
        f"{_gib(hardware.host_memory_bytes)} RAM"
    )
    return lines


def _profile_lines(profile: Any) -> list[str]:
    from engine.hardware.planner import SAFETY_MARGIN

    lines = ["Settings:"]
    for name, choice in profile.choices().items():
        value = (
            f"{choice.value:,}"
            if isinstance(choice.value, int) and not isinstance(choice.value, bool)
            else choice.value
        )
        lines.append(f"  {name:<18} {value!s:<10} {choice.reason}")
    plan = profile.memory_plan
    if plan is not None:
        verdict = "fits" if plan.fits else "does not fit"
        lines.append(
            f"Memory: {verdict}; predicted peak {plan.estimate.gib():.1f} GiB (+{SAFETY_MARGIN:.0%} margin), "
            f"{plan.budget_bytes / GIB:.1f} GiB usable"
        )
        if "resident_layers" in plan.reasons:
            lines.append(f"Resident layers: {plan.reasons['resident_layers']}")
        if "longest" in plan.reasons:
            lines.append(f"Longest row that trains: {plan.reasons['longest']}")
    if profile.tokens_per_second:
        lines.append(
            f"Speed: about {profile.tokens_per_second:,.0f} tokens/s (rough, from the card's tensor throughput)"
        )
    lines += [f"Note: {note}" for note in profile.notes]
    return lines


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--tokens-per-batch", type=int, dest="tokens", help="tokens per batch (default: the largest that fits)"
    )
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)  # the older spelling
    # the settings tunedeck train takes too, declared as it declares them (engine.config.setting_flag); QLoRA and
    # tokens per batch are left to choose here (the plan picks them), where train's defaults are fixed values
    _train_setting(parser, "data", "max_seq_len", type=int, default=0)
    parser.add_argument("--qlora", action=argparse.BooleanOptionalAction, default=None, help="force QLoRA on or off")
    _train_setting(parser, "speed", "checkpointing", default="auto")
    _train_setting(parser, "lora", "rank", type=int, default=16)


def _train_setting(parser: argparse.ArgumentParser, section: str, name: str, **changes: Any) -> None:
    flag, options = setting_flag(section, name)
    parser.add_argument(flag, **{**options, **changes})


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    found = {"qlora": args.qlora, "checkpointing": args.checkpointing, "tokens_per_batch": args.tokens}
    return {key: value for key, value in found.items() if value not in (None, "auto")}


def detect_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tunedeck detect", description="Show this machine's GPU, its class, and the settings TuneDeck picks."
    )
    parser.add_argument("--model", help="also plan memory for this model (built-in name, demo, folder or config.json)")
    _common(parser)
    args = parser.parse_args(argv)
    from engine.hardware.detect import detect_hardware
    from engine.hardware.profile import build_profile
    from engine.hardware.shapes import load_shape

    try:
        shape = load_shape(args.model) if args.model else None
        hardware = detect_hardware()
        profile = build_profile(hardware, shape, overrides=_overrides(args), lora_rank=args.lora_rank,
                                min_tokens=args.max_seq_len)  # fmt: skip
    except TuneDeckError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "profile": profile.to_dict()}, indent=2))
    else:
        print("\n".join([*_hardware_lines(hardware), "", *_profile_lines(profile)]))
        for note in hardware.notes:
            print(f"Note: {note}")
    return 0


PicturePlan = Callable[[argparse.Namespace, Any, Any], Any]
"""(the parsed flags, the device target, the profile) -> what a vision-language model's pictures add, or None."""


def plan_main(argv: list[str] | None = None, pictures_for: PicturePlan | None = None) -> int:
    """``tunedeck plan``; ``pictures_for`` adds a vision-language model's pictures (engine.cli.plan passes it, from
    the layer that knows vision models)."""
    parser = argparse.ArgumentParser(
        prog="tunedeck plan",
        description="Will a model train on a GPU, with which settings, about how fast. Nothing is downloaded.",
    )
    parser.add_argument(
        "--model", required=True, help="built-in shape (e.g. llama-3.1-8b), demo, a local HF folder or config.json"
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--gpu", help="a GPU by name, e.g. '4060 laptop', 'RTX 3090', 'H100' (default: this machine's)")
    target.add_argument("--vram", type=float, help="plan for a card with this many GiB (as an RTX 40-series card)")
    parser.add_argument("--list-gpus", action="store_true", help="list the GPUs the table knows and exit")
    parser.add_argument("--gpus", type=int, default=1, help="plan for this many such GPUs: DDP or FSDP2, and why")
    parser.add_argument("--parallel", choices=("auto", "ddp", "fsdp"), default="auto", help="force DDP or FSDP2")
    _common(parser)
    _train_setting(parser, "vision", "max_pixels", type=int, default=None)
    args = parser.parse_args(argv)
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget, build_profile
    from engine.hardware.shapes import load_shape

    if args.list_gpus:
        print("\n".join(f"{s.name:<26} sm_{s.compute_capability[0]}{s.compute_capability[1]:<3} {s.vram_gib:g} GiB"
                        for s in gpus.GPUS))  # fmt: skip
        return 0
    try:
        shape = load_shape(args.model)
        device = _plan_target(args, gpus, DeviceTarget)
        profile = build_profile(device, shape, overrides=_overrides(args), lora_rank=args.lora_rank,
                                min_tokens=args.max_seq_len)  # fmt: skip
    except TuneDeckError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    parallel = _parallel_plan(args, shape, device, profile) if args.gpus > 1 else None
    pictures = pictures_for(args, device, profile) if pictures_for is not None else None
    if args.json:
        report = {"model": shape.display_name(), "gpu": device.label, "profile": profile.to_dict()}
        if pictures is not None:
            report["pictures"] = dataclasses.asdict(pictures)
        if parallel is not None:
            report["parallel"] = dataclasses.asdict(parallel)
        print(json.dumps(report, indent=2))
        return 0
    memory = f"{device.memory_bytes / GIB:.0f} GiB" if device.memory_bytes else "? GiB"
    count = f"{args.gpus} x " if args.gpus > 1 else ""
    print(f"{shape.display_name()} on {count}{device.label} ({memory}):")
    print("\n".join(_profile_lines(profile)))
    if pictures is not None:
        print("\n".join(pictures.lines()))
    if parallel is not None:
        print(f"Several GPUs: {parallel.reason}")
    return 0


def _parallel_plan(args: argparse.Namespace, shape: Any, device: Any, profile: Any) -> Any:
    """DDP or FSDP2 over ``args.gpus`` cards like ``device``, for the one-card plan's settings."""
    from engine.hardware.parallel import choose_parallel
    from engine.hardware.planner import TrainSetup, usable_bytes
    from engine.hardware.row_lengths import GPU_MAX_SEQ_LEN

    plan = profile.memory_plan
    row = args.max_seq_len or GPU_MAX_SEQ_LEN
    setup = TrainSetup(
        tokens=args.tokens or (plan.tokens if plan is not None and plan.tokens else None) or row,
        qlora=bool(args.qlora if args.qlora is not None else plan is not None and plan.qlora),
        lora_rank=args.lora_rank,
        checkpointing=plan.checkpointing if plan is not None else checkpoint_choice.leanest_mode(can_offload=True),
    )
    budget = usable_bytes(device.memory_bytes or 0)
    return choose_parallel(
        shape, setup, args.gpus, budget, requested=args.parallel, compute_capability=device.compute_capability
    )


def generic_gpu_name(vram_gib: float) -> str:
    """The card ``--vram`` describes, by its memory: "an 8 GiB GPU", "a 12 GiB GPU"."""
    size = f"{vram_gib:g}"
    article = "an" if size.startswith("8") or size.split(".")[0] in ("11", "18") else "a"
    return f"{article} {size} GiB GPU"


def _plan_target(args: argparse.Namespace, gpus: Any, target_cls: Any) -> Any:
    if args.gpu:
        spec = gpus.find_gpu(args.gpu)
        if spec is None:
            raise TuneDeckError(f"unknown GPU '{args.gpu}'", hint="see `tunedeck plan --list-gpus`, or give --vram GIB")
        return target_cls.from_spec(spec)
    if args.vram:
        generic = gpus.GpuSpec(generic_gpu_name(args.vram), (8, 9), args.vram, 0, gpus.RTX_CONSUMER)
        memory = int(args.vram * GIB)
        return target_cls(generic.name, generic.gpu_class, generic.compute_capability, memory, assumed=True)
    from engine.hardware.detect import detect_hardware

    return target_cls.from_hardware(detect_hardware())


if __name__ == "__main__":  # python -m engine.hardware.cli detect|plan ...
    command, *rest = sys.argv[1:] or ["detect"]
    raise SystemExit({"detect": detect_main, "plan": plan_main}.get(command, detect_main)(rest))
