#!/usr/bin/env bash
# The GPU tests (gpu marker) on the GPU machine, one shard a call, each well within a call's 10 minutes:
#   scripts/gpu_tests.sh 1|2|3 [PYTEST_ARGS...]   one shard (tests/gpu_shards.py holds the table)
#   scripts/gpu_tests.sh all [PYTEST_ARGS...]     every shard in one process (longer than one call)
#   scripts/gpu_tests.sh list                     the table
# Wheels carried in .whl/ (../shared/gpu/fetch-wheels: bitsandbytes, datasets) are installed into /tmp/site first.
# With $OUT set, the log and a JUnit XML go there as gpu-tests-SHARD.log / .xml. PySide6 and pytest-qt are not
# needed (tests/conftest.py sets Qt up only where it imports). The shard stops itself after GPU_TESTS_TIMEOUT_S
# seconds (default 570) with an interrupt, so the tests that ran are still reported.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
python=${PYTHON:-python3}
shard=${1:-}
if [ -z "$shard" ]; then
  echo "usage: scripts/gpu_tests.sh SHARD [PYTEST_ARGS...]   (SHARD: 1, 2, 3, all or list)" >&2
  exit 2
fi
shift
if [ "$shard" = list ]; then
  exec "$python" tests/gpu_shards.py list
fi
selected=$("$python" tests/gpu_shards.py "$shard") || exit
mapfile -t selected <<<"$selected"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
fi

args=(-m gpu -p no:cacheprovider -rA --durations=15 --log-level=WARNING)  # no DEBUG trace logs in -rA reports
log=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  args+=(--junitxml "$OUT/gpu-tests-$shard.xml")
  log=$OUT/gpu-tests-$shard.log
fi
echo "shard $shard: ${#selected[@]} entries; $("$python" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")')"
timeout -s INT -k 30 "${GPU_TESTS_TIMEOUT_S:-570}" "$python" -m pytest "${args[@]}" "$@" "${selected[@]}" 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
