#!/usr/bin/env bash
# The shipped 8B config on one GPU, bf16 and the FP8 base each at its own auto, alternated in one call (carry
# .whl; FlashAttention-4 from .carry/fa4-site when an earlier call unpacked it: model.attention auto then runs
# it): scripts/e2e_sweep.py, one fresh process per entry of ORDER, each with WARMUP steps (one planned chunk)
# then CHUNKS timed chunks; the timed chunks of one entry are pooled (median and spread of each chunk's
# tokens/s). The default (4 runs of 3 timed chunks: 6 timed chunks per setting) takes ~5-6 minutes on an H100.
#   bash scripts/device/e2e_8b.sh
#   ORDER="bf16:auto,fp8:auto,fp8:bf16cap,bf16:auto,fp8:auto,fp8:bf16cap" CHUNKS=3   also FP8 at bf16's capacity
#   ORDER="bf16:auto,bf16:auto+model.attention=fa2,..."                               FA4 against FA2 end to end
# Writes $OUT/e2e-8b-1x<gpu>.json (h100 or h200) and each run's log under $OUT/e2e/.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
tag=$(echo "$name" | grep -o "H[0-9]00" | tr 'H' 'h'); tag=${tag:-gpu}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total,memory.used --format=csv,noheader
"$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
# shellcheck disable=SC2086
"$PY" scripts/e2e_sweep.py --order "${ORDER:-bf16:auto,fp8:auto,bf16:auto,fp8:auto}" \
  --timed-chunks "${CHUNKS:-3}" --warmup "${WARMUP:-2}" --timeout "${RUN_TIMEOUT:-200}" \
  --out "$OUT/e2e" --json "$OUT/e2e-8b-1x$tag.json" ${ARGS:-}
