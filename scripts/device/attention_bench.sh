#!/usr/bin/env bash
# Packed attention on one GPU, one call (carry .whl; FlashAttention-4 from .carry/fa4-site, unpacked by
# scripts/device/fa4_install.sh in an earlier call on the same machine): scripts/bench_attention.py (fa2 and fa4,
# forward and forward+backward on the 8B's packed shapes, error vs fp32, saved bytes), then the attention GPU
# tests. Writes $OUT/attention-<gpu>.json (h100 or h200), $OUT/attention.log, $OUT/gpu_tests.log.
#   bash scripts/device/attention_bench.sh          ARGS: more bench_attention.py arguments; GPU_TESTS=0
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
tag=$(echo "$name" | grep -o "H[0-9]00" | tr 'H' 'h'); tag=${tag:-gpu}
echo "$name"; git rev-parse --short HEAD 2>/dev/null || true
# shellcheck disable=SC2086
timeout "${TIMEOUT:-300}" "$PY" scripts/bench_attention.py --out "$OUT/attention-$tag.json" ${ARGS:-} 2>&1 \
  | grep -v '^{' | tee "$OUT/attention.log" | cut -c1-400
echo "bench rc=${PIPESTATUS[0]}"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/models/test_packed_attention.py \
    tests/models/test_attention_choice.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
