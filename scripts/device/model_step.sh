#!/usr/bin/env bash
# One packed microbatch through the 8B-shaped model on one GPU, one call (carry .whl): the LoRA kernels' GPU tests,
# then scripts/bench_model_step.py — four adapters vs one over the same tokens, and one A shared by a fused
# linear's projections vs PEFT's A per projection.
#   bash scripts/device/model_step.sh
#   VARIANTS (all four), ARGS (more bench_model_step arguments, e.g. --profile), GPU_TESTS=0, TIMEOUT (300 s)
# Writes $OUT/model_step.json, $OUT/model_step.log, $OUT/gpu_tests.log.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_fused_projections.py 2>&1 \
    | tail -5 | tee "$OUT/gpu_tests.log"
fi
# shellcheck disable=SC2086
timeout "${TIMEOUT:-300}" "$PY" scripts/bench_model_step.py --out "$OUT/model_step.json" \
  --variants "${VARIANTS:-one_r16,four_r16,one_r64,four_r16_shared_a}" ${ARGS:-} 2>&1 \
  | grep -v '^{' | tail -60 | tee "$OUT/model_step.log"
