#!/usr/bin/env bash
# The runs behind qlora_step_readout_h200.{json,md}, history/qlora_fp8_recompute_h200.{json,md} and
# qlora_memory_peak_h200.md, on one H200 (run tool, kind nvidia-h200), from the repo root, one process each.
# GPU tests of the same round: pytest tests/test_step_readout_gpu.py tests/test_reliability_gpu.py
# "tests/test_speed_gpu.py::test_fp8_only_in_the_recompute_keeps_the_16bit_forward_on_gpu" (--noconftest where
# PySide6 is not installed).
set -u
OUT=${OUT:-/tmp/qlora_step_readout}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
python3 -m engine.bench.qlora --models llama-3.1-8b --tokens 4096 --caps 8 \
    --variants auto+read_immediate,auto+read_late,auto,auto+fp8_base+fp8_recompute_only+read_late,auto+fp8_base+step_graphs+fp8_recompute_only+read_late,auto+fp8_base+step_graphs+read_late \
    --warmup 2 --steps 6 --loss-steps 0 --out "$OUT/qlora_step_readout_h200.json" > "$OUT/readout.log" 2>&1
python3 -m engine.bench.qlora --models llama-3.1-8b --tokens 4096 --caps 8 \
    --variants auto,auto+fp8_base+fp8_recompute_only,auto+fp8_base \
    --warmup 1 --steps 1 --loss-steps 20 --out "$OUT/qlora_fp8_recompute_h200.json" > "$OUT/losses.log" 2>&1
python3 benchmarks/qlora_memory_peak_h200.py "$OUT/profile" 16384,49152 > "$OUT/memory_peak.log" 2>&1
grep -h "tokens cap\|tokens:\|Error" "$OUT"/*.log | grep -v Warning
