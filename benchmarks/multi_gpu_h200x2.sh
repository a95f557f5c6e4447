#!/usr/bin/env bash
# The multi-GPU check and scaling measurement on two H200s (run tool, kind nvidia-h200-x2), from the repo root.
# Needs a 360 s call. Writes into ${OUT:-/tmp/multi-gpu}: multi_gpu_h200x2.{json,md}, gpu_tests.log, topology.txt.
set -u
OUT=${OUT:-/tmp/multi-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=.
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
python3 -c 'import torch; print("gpus", torch.cuda.device_count(), torch.__version__)'
# Each torchrun's first step compiles the fused kernels (about 75 s per process, benchmarks/speed_h200.md).
# --speed all-eager keeps the fused kernels off so that neither run spends its first minute compiling.
timeout 150 python3 -m engine.bench.multi_gpu --gpus 2 --shape llama-3.2-1b --tokens 16384 --steps 8 --warmup 3 \
    --speed all-eager --timeout 70 --out "$OUT/multi_gpu_h200x2" > "$OUT/bench.log" 2>&1
echo "bench exit $?"
timeout 90 python3 -m pytest tests/test_distributed.py -m gpu -x -q -s -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"
tail -5 "$OUT/gpu_tests.log"
tail -25 "$OUT/bench.log"
