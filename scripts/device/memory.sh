#!/usr/bin/env bash
# One device call: the memory-model calibration grid (scripts/calibrate_memory.py measure), raw points under
# $OUT/memory-raw.json, then the fit and held-out check when the model is there.
#   run (device tool, carry .whl):  bash scripts/device/memory.sh [BUDGET_S]
set -uo pipefail
source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
timeout $(( ${1:-330} + 120 )) "$PY" scripts/calibrate_memory.py measure --out "$OUT/memory-raw.json" \
  --budget-s "${1:-330}" > "$OUT/memory-measure.log" 2>&1
echo "measure rc=$?"; grep -v '^{' "$OUT/memory-measure.log" | grep -v -i warn | tail -15
grep -c '^{' "$OUT/memory-measure.log"
"$PY" scripts/calibrate_memory.py fit "$OUT/memory-raw.json" --json "$OUT/memory-model.json" 2>&1 | tail -40
