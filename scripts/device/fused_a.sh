#!/usr/bin/env bash
# Issue 25 in one device call: the GPU run of the per-projection LoRA kernel tests, then scripts/bench_fused_a.py
# (the 8B-shaped model's forward + backward, an A per projection vs a shared A), logs and JSON under $OUT.
#   run (device tool, carry .whl + this tree):  bash scripts/device/fused_a.sh
set -uo pipefail
if PYTHONPATH=$PWD:/tmp/site python3 -c 'import megatron.core, pulp' 2>/dev/null; then  # a warm machine has them
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site OUT=${OUT:-/tmp/out} PY=python3; mkdir -p "$OUT"
else
  . scripts/device/setup.sh
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout ${TEST_TIMEOUT:-60} "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_fused_projections.py 2>&1 \
  | tail -5 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-150} "$PY" scripts/bench_fused_a.py --out "$OUT/fused_a.json" ${BENCH_ARGS:-} 2>&1 \
  | grep -v '^{' | tail -20 | tee "$OUT/bench.log"
