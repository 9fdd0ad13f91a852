#!/usr/bin/env bash
# The FP8 frozen base on one GPU (carry .whl), one device call per PHASE:
#   PHASE=bench: scripts/bench_train.py on configs/llama3.1-8b-4adapters.yaml, one process each, one after the
#     other: bf16 and fp8 at token_capacity $CAP, both without recompute (like for like), then fp8 at token_capacity
#     auto with the config's recompute_layers: auto (what the freed memory gives); BENCH_SPECS="bf16 fp8 bf16auto"
#     swaps the last for bf16 at its own auto capacity;
#   PHASE=quality: scripts/check_fp8.py (per-layer error and GEMM times on the 8B shapes, the LoRA linear
#     forward+backward, every LoRA gradient's cosine against the bf16 base, a profiled step; QUALITY_ARGS);
#   PHASE=quickstart: scripts/fp8_quickstart.py: configs/quickstart.yaml (model.dtype=bfloat16) trained with a bf16
#     and an fp8 base per seed in QS_SEEDS (1234 1 2), greedy answers to its held-out prompts, the verdict and the
#     loss curves overlaid;
#   PHASE=main: bench, quality, then the FP8 GPU tests; PHASE=all (default): main with the quickstart pair run
#     while the tests run (neither is timed); PHASE=checks: the tests and the quickstart side by side only.
#   run:  PHASE=all bash scripts/device/fp8.sh
# Writes under $OUT: run.log, bf16.json, fp8.json, fp8auto.json (bench); fp8_quality.json (quality);
# gpu_tests.log; quickstart.json, fp8-quickstart-loss.png, qs.log (quickstart).
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
PHASE=${PHASE:-all}; CAP=${CAP:-12288}; L=/tmp/fp8logs; mkdir -p "$L"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$SECONDS
bench() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
  "$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
  NORC="model.recompute=false model.recompute_layers=null"
  # name:capacity:precision:extra overrides; BENCH_SPECS (space-separated names) picks among them
  declare -A SPEC=([bf16]="bf16:$CAP:bf16:$NORC" [fp8]="fp8:$CAP:fp8:$NORC" [fp8auto]="fp8auto:auto:fp8:"
                   [bf16auto]="bf16auto:auto:bf16:")
  for key in ${BENCH_SPECS:-bf16 fp8 fp8auto}; do
    spec=${SPEC[$key]}
    IFS=: read -r name cap prec extra <<< "$spec"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-150}" "$PY" scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml \
      --rows 256 --steps "${STEPS:-6}" --warmup 2 --skip-hf --out "/tmp/bench_$name" \
      scheduler.token_capacity="$cap" model.base_precision="$prec" $extra > "$L/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS-T0))s"; tail -1 "$L/$name.log" > "$OUT/$name.json"
    grep -v "^{" "$L/$name.log" | grep -i "tokens/s\|error\|Traceback\|lorafusion \|capacity" | head -6
  done
}
quality() {
  timeout "${QUALITY_TIMEOUT:-200}" "$PY" scripts/check_fp8.py --out "$OUT/fp8_quality.json" ${QUALITY_ARGS:-} \
    > "$L/quality.log" 2>&1
  echo "quality rc=$? $((SECONDS-T0))s"; grep -v -i "warn" "$L/quality.log" | cut -c1-400 | tail -12
}
gpu_tests() {
  timeout "${TESTS_TIMEOUT:-150}" "$PY" -m pytest -q -p no:cacheprovider -m "${TEST_MARK:-gpu}" \
    tests/ops/test_fp8_linear.py tests/layers/test_fp8_base.py > "$L/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$L/gpu_tests.log"
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_fp8_lora.py >> "$L/gpu_tests.log" 2>&1
  echo "one-op tests rc=$? $((SECONDS-T0))s"; tail -3 "$L/gpu_tests.log"
  grep -v "DEBUG\|^$" "$L/gpu_tests.log" | tail -60 > "$OUT/gpu_tests.log"
}
quickstart() {  # bf16 and FP8 base per seed in QS_SEEDS, all at once on the GPU (scripts/fp8_quickstart.py)
QS_SEEDS=${QS_SEEDS:-1234 1 2}
# shellcheck disable=SC2086
timeout "${QS_TIMEOUT:-300}" "$PY" scripts/fp8_quickstart.py run --seeds $QS_SEEDS --work /tmp/qs ${QS_ARGS:-}
echo "quickstart runs rc=$? $((SECONDS-T0))s"
# shellcheck disable=SC2086
"$PY" scripts/fp8_quickstart.py report --seeds $QS_SEEDS --work /tmp/qs --json "$OUT/quickstart.json" \
  --png "$OUT/fp8-quickstart-loss.png"
tail -n 5 /tmp/qs/logs/*.log | grep -v DEBUG > "$OUT/qs.log"
}
case "$PHASE" in
  bench) bench ;;
  quality) quality ;;
  main) bench; quality; gpu_tests ;;
  quickstart) quickstart ;;
  checks) quickstart > "$L/quickstart.out" 2>&1 & QS=$!; gpu_tests; wait "$QS"; cat "$L/quickstart.out" ;;
  all) bench; quality; quickstart > "$L/quickstart.out" 2>&1 & QS=$!; gpu_tests; wait "$QS"; cat "$L/quickstart.out" ;;
esac
echo "done $((SECONDS-T0))s"
