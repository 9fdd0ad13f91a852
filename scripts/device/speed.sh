#!/usr/bin/env bash
# End-to-end training speed on one GPU, one call (carry .whl): the GPU tests, then the runs named by the
# arguments (each "NAME:ARGS..." runs scripts/bench_train.py on CONFIG, default the 8B config, with those
# arguments), logs and each run's JSON under $OUT.
#   bash scripts/device/speed.sh "ours:--ablate" "prof8k:--profile --skip-hf scheduler.token_capacity=8192"
#   GPU_TESTS=0 skips the tests; ROWS (256), STEPS (6), WARMUP (2), RUN_TIMEOUT (400 s), TAIL (25)
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
if [ "${GPU_TESTS:-1}" = 1 ]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_PATHS:-tests} 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
"$PY" scripts/make_bench_data.py --out data/bench --rows ${ROWS:-256} >/dev/null
for spec in "$@"; do
  name=${spec%%:*}; args=${spec#*:}
  echo "=== $name: $args"
  # shellcheck disable=SC2086
  timeout ${RUN_TIMEOUT:-400} "$PY" scripts/bench_train.py --config ${CONFIG:-configs/llama3.1-8b-4adapters.yaml} \
    --rows ${ROWS:-256} --steps ${STEPS:-6} --warmup ${WARMUP:-2} --out /tmp/bench_$name $args > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -v "^{" "$OUT/$name.log" | tail -${TAIL:-25}; tail -1 "$OUT/$name.log" > "$OUT/$name.json"
done
