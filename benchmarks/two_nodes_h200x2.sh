#!/usr/bin/env bash
# Two computers as one, on a two-GPU host (run tool, kind nvidia-h200-x2), from the repo root: one GPU, one node of
# two GPUs, and two nodes of one GPU each with NCCL forced onto TCP sockets over the loopback (no shared memory, no
# peer-to-peer). Needs a 600 s call. Writes into ${OUT:-/tmp/two-nodes}: two_nodes_h200x2.{json,md}, bench.log,
# topology.txt. Copy the json and md into benchmarks/ to commit them.
set -u
OUT=${OUT:-/tmp/two-nodes}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=.
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
python3 -c 'import torch; print("gpus", torch.cuda.device_count(), torch.__version__)'
# Three runs of 12 steps on a random-weight Llama-3.2-1B shape with 8,192-token rows (two rows a step); the first
# steps compile the fused kernels, so tokens/s leaves out the first 4.
timeout 560 python3 -m engine.bench.two_nodes --shape llama-3.2-1b --tokens 8192 --steps 12 --warmup 4 \
    --timeout 170 --out "$OUT/two_nodes_h200x2" > "$OUT/bench.log" 2>&1
echo "bench exit $?"
tail -25 "$OUT/bench.log"
