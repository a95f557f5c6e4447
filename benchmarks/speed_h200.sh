#!/usr/bin/env bash
# The dense speed benchmark on one H200 (run tool, kind nvidia-h200), from the repo root: both models in parallel
# processes that compile side by side and then time one at a time (--timing-lock), plus each model's all-on profile.
# Writes into ${OUT:-/tmp/speed}: <model>.jsonl (rows), <model>.log, prof/<model>/top_{kernels,ops}.txt, and for
# the variants in $MEMORY prof/<model>/<variant>_memory_peak.txt (what is alive at the memory peak, by site).
# Then, here: python -m engine.bench.speed --merge OUT/*.jsonl --moe-blocks= --carry-moe benchmarks/speed_h200.json ...
# CHUNK_TOKENS sets the chunked-MLP variants' chunk size (default: the model's own). The offloaded memory targets:
#   VARIANTS=stock+standard_ckpt,all_on+offloaded_ckpt,all_on+offloaded_ckpt+chunked_mlp CHUNK_TOKENS=4096 \
#   MEMORY=all_on+offloaded_ckpt,all_on+offloaded_ckpt+chunked_mlp LOSS_STEPS=0 benchmarks/speed_h200.sh
set -u
OUT=${OUT:-/tmp/speed}
VARIANTS=${VARIANTS:-stock,metadata_cache,fused_loss,lora_16bit,all_on-lora_16bit,all_on,stock+standard_ckpt,all_on+offloaded_ckpt}
mkdir -p "$OUT/prof"
export PYTHONPATH=. HF_HUB_OFFLINE=1
LOCK="$OUT/lock/timing"
# The bf16 matmul peak for MFU, measured on the idle GPU before the two processes start.
PEAK=$(python3 -c "from engine.bench.speed import matmul_peak_tflops; print(round(matmul_peak_tflops()))")
echo "bf16 matmul peak (idle GPU): $PEAK TFLOP/s"
for model in llama-3.2-1b qwen3-0.6b; do
    timeout "${LIMIT:-540}" python3 -m engine.bench.speed --models "$model" --moe-blocks= --tokens 16384 --long-tokens 0 \
        --steps 3 --warmup 1 --loss-steps "${LOSS_STEPS:-20}" --loss-tokens 2048 --variants "$VARIANTS" \
        --compile-first --timing-lock "$LOCK" --peers 2 --rows-log "$OUT/$model.jsonl" \
        --peak-tflops "$PEAK" --profile-dir "$OUT/prof" --profile-variants "${PROFILE:-all_on}" \
        --memory-variants "${MEMORY:-}" ${CHUNK_TOKENS:+--chunk-tokens "$CHUNK_TOKENS"} --out "/tmp/speed-$model.json" > "${LOGS:-$OUT}/$model.log" 2>&1 &
done
wait
rm -rf "$OUT/lock"
grep -h " ms \|compiled\|ERROR\|Error\|relative" "${LOGS:-$OUT}"/*.log | tail -40
