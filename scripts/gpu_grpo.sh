#!/usr/bin/env bash
# GRPO on the GPU machine in one call: tunedeck bench --grpo, stock TRL against tunedeck train --method grpo on a
# Qwen3-0.6B-shaped model (first its two-layer smoke run, seconds), the record (JSON + Markdown) written to
# $OUT/grpo_h200.json (benchmarks/grpo_h200.json without $OUT).
# Usage, from the repository root: scripts/gpu_grpo.sh [BENCH_ARGS...]   (e.g. --sides trl,tunedeck)
# Wheels carried in .whl/ (trl, datasets and their needs; ../shared/gpu/fetch-wheels trl==1.16.0) are installed
# into /tmp/site first. The bench's work folder is /tmp/grpo-bench; its logs are copied to $OUT/grpo-logs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
source scripts/gpu_setup.sh

started=$SECONDS
timeout -s INT -k 20 "${GPU_GRPO_SMOKE_TIMEOUT_S:-120}" "$python" -m engine.bench grpo --tiny --sides trl,tunedeck \
  --work /tmp/grpo-smoke --out "$out/grpo_smoke.json"
smoke_status=$?
echo "smoke: exit $smoke_status after $((SECONDS - started)) s"
mkdir -p "$out/grpo-logs" && cp -r /tmp/grpo-smoke/logs "$out/grpo-logs/smoke" 2>/dev/null
[ "$smoke_status" -eq 0 ] || exit "$smoke_status"

started=$SECONDS
timeout -s INT -k 20 "${GPU_GRPO_BENCH_TIMEOUT_S:-420}" "$python" -m engine.bench grpo --work /tmp/grpo-bench \
  --out "$out/grpo_h200.json" "$@"
bench_status=$?
echo "bench: exit $bench_status after $((SECONDS - started)) s"
cp -r /tmp/grpo-bench/logs "$out/grpo-logs/bench" 2>/dev/null
[ -f "$out/grpo_h200.md" ] && cat "$out/grpo_h200.md"
[ "$bench_status" -eq 0 ]
