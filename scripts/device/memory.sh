#!/usr/bin/env bash
# One device call for the memory model (issue 22): the calibration grid (scripts/calibrate_memory.py measure,
# BUDGET_S seconds), the fit and held-out check (coefficients written into this tree and $OUT), then the shipped
# 8B config end to end: auto (token_capacity and recompute_layers) vs the hand-picked capacity HAND, same call;
# last, `lorafusion train` at a capacity that cannot fit (the runtime out-of-memory error), if time is left.
#   run (device tool, carry .whl):  BENCH_COMMIT=abc1234 bash scripts/device/memory.sh [BUDGET_S] [HAND]
set -uo pipefail
source "$(dirname "$0")/setup.sh"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
timeout $(( ${1:-240} + 120 )) "$PY" scripts/calibrate_memory.py measure --out "$OUT/memory-raw.json" \
  --budget-s "${1:-240}" > "$OUT/memory-measure.log" 2>&1
echo "measure rc=$? points=$(grep -c '^{' "$OUT/memory-measure.log") t=$(( $(date +%s) - T0 ))s"
grep -v '^{' "$OUT/memory-measure.log" | grep -iv 'warn' | tail -5
"$PY" scripts/calibrate_memory.py fit "$OUT/memory-raw.json" --json "$OUT/memory-model.json" --write-coefficients \
  > "$OUT/memory-fit.log" 2>&1; echo "fit rc=$?"; tail -1 "$OUT/memory-fit.log"
cp lorafusion/scheduler/memory_coefficients.json "$OUT/" 2>/dev/null
"$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
for spec in "auto:" "hand:scheduler.token_capacity=${2:-12288} model.recompute=false model.recompute_layers=null"; do
  name=${spec%%:*}; args=${spec#*:}
  echo "=== e2e $name: $args  t=$(( $(date +%s) - T0 ))s"
  # shellcheck disable=SC2086
  timeout 200 "$PY" scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml --rows 256 --steps 6 \
    --warmup 2 --skip-hf --out /tmp/bench_$name $args > "$OUT/e2e-$name.log" 2>&1
  echo "rc=$?"; grep -v '^{' "$OUT/e2e-$name.log" | grep -E "memory plan|stage|^ +[0-9]|lorafusion |system" | tail -8
  tail -1 "$OUT/e2e-$name.log" > "$OUT/e2e-$name.json"
done
if [ $(( $(date +%s) - T0 )) -lt 470 ]; then
  echo "=== train at token_capacity 16384 without recompute (does not fit 80 GB)  t=$(( $(date +%s) - T0 ))s"
  timeout 90 "$PY" -m lorafusion.cli train configs/llama3.1-8b-4adapters.yaml scheduler.token_capacity=16384 \
    model.recompute=false model.recompute_layers=null output_dir=/tmp/oomrun logging.progress=false 2>&1 \
    | grep -iv warn | tail -6; echo "rc=${PIPESTATUS[0]}"
fi
echo "total t=$(( $(date +%s) - T0 ))s"
