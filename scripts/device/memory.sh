#!/usr/bin/env bash
# Device calls for the memory model: peak memory over a grid, and the shipped auto capacity end to end.
#   MODE=measure: the calibration grid (scripts/calibrate_memory.py measure, BUDGET_S seconds; EXTRA_CAPS adds
#     capacities to the 8B shape's grid, e.g. 20480,24576 on a 141 GB GPU), then the committed coefficients checked
#     on every point (all held out) and a refit on this GPU's points (reported, not written).
#   MODE=e2e: the shipped 8B config end to end, unchanged (`auto` token_capacity and recompute_layers), beside each
#     hand-picked capacity in HAND (no recompute), same call, one process per run in ORDER (scripts/e2e_sweep.py:
#     e.g. ORDER=auto,24576,20480,auto; $OUT/e2e-summary.json, logs in $OUT/e2e-logs.tgz); then (MODE=all)
#     `lorafusion train` at a capacity that cannot fit (the runtime out-of-memory error) if time is left.
#   MODE=all (default): both, the fit written into this tree's coefficients.
#   run (device tool, carry .whl):  BENCH_COMMIT=abc1234 [MODE=..] bash scripts/device/memory.sh [BUDGET_S] ["HAND ..."]
set -uo pipefail
source "$(dirname "$0")/setup.sh"
T0=$(date +%s)
MODE=${MODE:-all}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
if [ "$MODE" != e2e ]; then
  timeout $(( ${1:-240} + 90 )) "$PY" scripts/calibrate_memory.py measure --out "$OUT/memory-raw.json" \
    --budget-s "${1:-240}" --extra-capacities "${EXTRA_CAPS:-}" --shapes "${SHAPES:-8b,70b-width}" > "$OUT/memory-measure.log" 2>&1
  echo "measure rc=$? points=$(grep -c '^{' "$OUT/memory-measure.log") t=$(( $(date +%s) - T0 ))s"
  grep -v '^{' "$OUT/memory-measure.log" | grep -iv 'warn' | tail -5
  "$PY" scripts/calibrate_memory.py fit "$OUT/memory-raw.json" --coefficients lorafusion/scheduler/memory_coefficients.json \
    --json "$OUT/memory-check.json" > "$OUT/memory-check.log" 2>&1; echo "check rc=$?"; tail -1 "$OUT/memory-check.log" | cut -c 1-200
  grep -o '"max_abs_error_pct_held_out.*' "$OUT/memory-check.log"
  WRITE=$([ "$MODE" = all ] && echo --write-coefficients)
  "$PY" scripts/calibrate_memory.py fit "$OUT/memory-raw.json" --subset both --json "$OUT/memory-model.json" $WRITE \
    > "$OUT/memory-fit.log" 2>&1; echo "fit rc=$?"; grep -o '"max_abs_error_pct_held_out.*' "$OUT/memory-fit.log"
fi
[ "$MODE" = measure ] && { echo "total t=$(( $(date +%s) - T0 ))s"; exit 0; }
"$PY" -c 'import torch; f, t = torch.cuda.mem_get_info(); print(f"free {f / 2**30:.2f} of {t / 2**30:.2f} GiB")'
"$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
# one fresh process per run, in ORDER (comma-separated: auto or a capacity; default auto then HAND), e.g.
# ORDER=auto,24576,20480,auto: auto first and last, so the run that compiles the call's kernels is visible
ORDER=${ORDER:-auto,$(echo "${2:-12288}" | tr ' ' ',')}
"$PY" scripts/e2e_sweep.py --order "$ORDER" --timeout "${E2E_TIMEOUT:-200}" --out "$OUT/e2e" \
  --json "$OUT/e2e-summary.json" 2>&1
tar czf "$OUT/e2e-logs.tgz" -C "$OUT" e2e && rm -rf "$OUT/e2e"  # (few files come back: the logs in one)
if [ "$MODE" = all ] && [ $(( $(date +%s) - T0 )) -lt 470 ]; then
  echo "=== train at token_capacity 16384 without recompute (does not fit 80 GB)  t=$(( $(date +%s) - T0 ))s"
  timeout 90 "$PY" -m lorafusion.cli train configs/llama3.1-8b-4adapters.yaml scheduler.token_capacity=16384 \
    model.recompute=false model.recompute_layers=null output_dir=/tmp/oomrun logging.progress=false 2>&1 \
    | grep -iv warn | tail -6; echo "rc=${PIPESTATUS[0]}"
fi
echo "total t=$(( $(date +%s) - T0 ))s"
