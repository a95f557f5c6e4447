#!/usr/bin/env bash
# The runs behind qlora_one_pass_h200.{json,md}, on one H200 (run tool, kind nvidia-h200), from the repo root.
# Each command is one process; their JSON files were bundled into qlora_one_pass_h200.json with the kernels' own
# timings (kernels_alone_ms). The GPU tests of both kernels: pytest tests/test_speed_gpu.py -k "loss_kernel or e4m3
# or one_pass" (--noconftest where PySide6 is not installed).
set -u
OUT=${OUT:-/tmp/qlora_one_pass}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
bench() {  # name, then tunedeck bench --qlora arguments
    local name=$1
    shift
    python3 -m engine.bench.qlora --models llama-3.1-8b --caps 8 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
}
# 4,096 tokens: automatic against both opt-in switches, one step of each profiled
bench one_pass_4096 --tokens 4096 --variants auto,auto+fp8_base+step_graphs --warmup 2 --steps 6 --loss-steps 0 \
    --profile-dir "$OUT/profile"
# 20-step losses of the fp8 row against the automatic path
bench one_pass_4096_losses --tokens 4096 --variants auto,auto+fp8_base+step_graphs --warmup 1 --steps 2 \
    --loss-steps 20
# 16,384 tokens
bench one_pass_16384 --tokens 16384 --variants auto,auto+fp8_base,auto+fp8_base+step_graphs --warmup 1 --steps 3 \
    --loss-steps 0
grep -h "tokens cap\|Error\|error" "$OUT"/*.log | grep -v Warning
