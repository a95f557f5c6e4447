#!/usr/bin/env bash
# The QLoRA benchmark on one H200 (run tool, kind nvidia-h200), from the repo root: Llama-3.1-8B with every variant
# and Qwen3-8B (stock and automatic) in two processes that compile side by side and then time one at a time
# (--timing-lock). Writes ${OUT:-/tmp/qlora}/<model>.json, .jsonl (rows as measured) and .log.
# Then, here: tunedeck bench --qlora --merge OUT/*.json --out benchmarks/qlora_h200.json
set -u
OUT=${OUT:-/tmp/qlora}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
LOCK="$OUT/lock/timing"
run() {  # model variants
    timeout "${LIMIT:-540}" python3 -m engine.bench --qlora --models "$1" --variants "$2" --warmup 1 --steps 3 \
        --timing-lock "$LOCK" --peers 2 --rows-log "$OUT/$1.jsonl" --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
}
run llama-3.1-8b "stock,auto,auto-whole_row,auto-fused_kernels,auto-lean_recompute,auto-dequant_once,auto-host_embedding,auto-fused_loss,auto-metadata_cache" &
run qwen3-8b "stock,auto" &
wait
rm -rf "$OUT/lock"
grep -h "tokens cap\|Error\|error" "$OUT"/*.log | grep -v Warning | tail -40
