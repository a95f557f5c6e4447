"""What is alive at the peak of Llama-3.1-8B QLoRA long rows under a 24 GiB cap, beside the planner's parts.

Run on a GPU from the repo root: ``python benchmarks/qlora_memory_peak_h200.py OUT 16384,49152 [CAP [auto]]``.
Writes one ``llama8b_<tokens>_memory_peak.txt`` per length under OUT (engine.bench.memory) and prints measured and
planned peaks. CAP: the allocator cap in GiB (24); ``auto``: the QLoRA bench's automatic switches instead of the
long-context bench's memory switches.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from engine.bench import long_context as lc
from engine.bench.memory import record_peak
from engine.bench.speed import bench_adamw
from engine.hardware.planner import GIB, estimate_memory, setup_from_speed_state
from engine.hardware.shapes import ModelShape
from engine.speed import SpeedController


def main(out: Path, lengths: list[int], cap_gib: float = 24.0, automatic: bool = False) -> None:
    from engine.bench.qlora import AUTO

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total, device)
    config = lc.llama_8b_config()
    model = lc.with_lora(lc.build_quantized_model(config, device), "tunedeck")
    model.train()
    optimizer = bench_adamw(model, 1e-4)
    shape = ModelShape.from_config_dict(lc.LLAMA_8B, "llama-3.1-8b")
    controller = SpeedController(model, AUTO if automatic else lc.speed_settings("tunedeck"), device)
    for tokens in lengths:
        batch = lc.one_document(tokens, config.vocab_size).to(device)

        def step() -> None:
            loss = controller.loss(model, controller.model_inputs(batch), batch.labels, batch.trained_tokens)  # noqa: B023
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() / GIB
        setup = setup_from_speed_state(controller.state(), shape, tokens, qlora=True, lora_rank=32)
        estimate = estimate_memory(shape, setup)
        planned = estimate.peak / GIB
        seconds = time.perf_counter() - start
        error = planned / measured - 1
        print(f"{tokens}: measured {measured:.2f} GiB, planned {planned:.2f} GiB ({error:+.1%}), {seconds:.0f} s")
        print(f"  before the step {before / GIB:.3f} GiB; planned {estimate_parts(estimate)}")
        record_peak(step, out, f"llama8b_{tokens}")


def estimate_parts(estimate: object) -> str:
    return ", ".join(f"{k} {v / GIB:.3f}" for k, v in vars(estimate).items() if isinstance(v, int))


if __name__ == "__main__":
    cap = float(sys.argv[3]) if len(sys.argv) > 3 else 24.0
    main(Path(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")], cap, sys.argv[4:5] == ["auto"])
