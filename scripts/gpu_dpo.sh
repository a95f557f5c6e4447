#!/usr/bin/env bash
# DPO on the GPU machine in one call (about 5 minutes on an H200, well within a call's 10):
#   1. tests/test_dpo_gpu.py: TuneDeck's DPO with its speed switches on against TRL's DPOTrainer, step by step,
#      within bf16 noise;
#   2. tunedeck bench --dpo: stock TRL against tunedeck train --method dpo on a Qwen3-0.6B-shaped model, the record
#      (JSON + Markdown) written to $OUT/dpo_h200.json (benchmarks/dpo_h200.json without $OUT).
# Usage, from the repository root: scripts/gpu_dpo.sh [BENCH_ARGS...]   (e.g. --shape llama-3.2-1b)
# Wheels carried in .whl/ (trl, datasets and their needs; ../shared/gpu/fetch-wheels trl==1.16.0) are installed
# into /tmp/site first. The test's log goes to $OUT/gpu-dpo-test.log; the bench's work folder is /tmp/dpo-bench.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
source scripts/gpu_setup.sh

started=$SECONDS
timeout -s INT -k 20 "${GPU_DPO_TEST_TIMEOUT_S:-240}" "$python" -m pytest -m gpu -p no:cacheprovider -rA \
  --log-level=WARNING tests/test_dpo_gpu.py 2>&1 | tee "$out/gpu-dpo-test.log"
test_status=${PIPESTATUS[0]}
echo "test: exit $test_status after $((SECONDS - started)) s"

started=$SECONDS
timeout -s INT -k 20 "${GPU_DPO_BENCH_TIMEOUT_S:-330}" "$python" -m engine.bench dpo --work /tmp/dpo-bench \
  --out "$out/dpo_h200.json" "$@"
bench_status=$?
echo "bench: exit $bench_status after $((SECONDS - started)) s"

echo
echo "test_dpo_gpu.py: $(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$out/gpu-dpo-test.log" | tail -1)"
[ -f "$out/dpo_h200.md" ] && cat "$out/dpo_h200.md"
[ "$test_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
