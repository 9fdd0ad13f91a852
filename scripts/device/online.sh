#!/usr/bin/env bash
# Job completion times of a real online replay on one GPU, one device call (carry .whl): the GPU trace (docs/results/online-trace-gpu.yaml,
# 8 jobs, 8B shape) under each policy, after a discarded warm-up run: separate (today's practice: one
# `lorafusion train` per job in arrival order, each paying its setup), then one serving `lorafusion train` per
# scheduler.policy (fifo = one job at a time in arrival order; shortest_first); the simulator's prediction beside
# them (POLICIES=together adds the all-at-once policy). The JSON is rewritten after each policy.
#   run (kind nvidia-h200 or nvidia-h100-x1):  BENCH_COMMIT=<hash> bash scripts/device/online.sh
# Writes $OUT/online-jct-gpu.json and $OUT/online.log (copy the JSON to docs/results/).
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
"$PY" scripts/replay_online.py --config "${CONFIG:-configs/llama3.1-8b-4adapters.yaml}" \
  --trace "${TRACE:-docs/results/online-trace-gpu.yaml}" --out "$OUT/online-jct-gpu.json" --work /tmp/online-work \
  --policies "${POLICIES:-separate,fifo,shortest_first}" --warmup --simulate --device "1x ${DEVICE:-CPU}" \
  --commit "${BENCH_COMMIT:-unknown}" --timeout "${TIMEOUT:-400}" \
  scheduler.token_capacity=16384 scheduler.lookahead_batches=1 ${OVERRIDES:-} 2>&1 | tail -40 | tee "$OUT/online.log"
