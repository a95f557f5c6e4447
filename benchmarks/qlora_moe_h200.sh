#!/usr/bin/env bash
# Qwen3-30B-A3B-shaped QLoRA with 4-bit experts under a 24 GiB cap, on one H200 (about 5 minutes).
# Random init from the shape's config, built on the meta device and quantized layer by layer on the GPU;
# LoRA r32 on the attention projections; the `auto` variant only (stock keeps the experts in 16-bit: ~54 GiB).
# Run from the repository root; writes ${OUT:-/tmp/qlora}/moe.json and .md.
set -euo pipefail
out="${OUT:-/tmp/qlora}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)
python3 -m engine.bench.qlora --models qwen3-30b-a3b --variants auto --tokens 4096 --caps 24 \
    --warmup 1 --steps 3 --loss-steps 0 --out "$out/moe.json"
echo "finished in $(( $(date +%s) - start )) s"
python3 - "$out/moe.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for model in report["models"]:
    for row in model["rows"]:
        if row.get("ok"):
            print(f"{row['model']} {row['variant']} {row['tokens']} tokens, cap {row['cap_gib']:g} GiB: "
                  f"{row['ms_per_step']:.0f} ms/step, {row.get('tokens_per_s', 0):,.0f} tok/s, "
                  f"peak {row['peak_gib']:.2f} GiB (planned {row.get('planned_peak_gib') or 0:.2f}), "
                  f"{row['syncs']} syncs")
        else:
            print(f"{row['model']} {row['variant']} {row['tokens']} tokens, cap {row['cap_gib']:g} GiB: "
                  f"FAILED {row.get('error')}")
    for note in model.get("notes", []):
        print(note)
PY
