#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the 8B-shaped end-to-end runs named
# by the arguments (each "NAME:ARGS..." runs scripts/bench_train.py with those arguments), logs under $OUT.
#   run (device tool, carry .whl):  bash scripts/device/speed.sh "prof8k:--profile --skip-hf scheduler.token_capacity=8192"
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
if [ "${GPU_TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_PATHS:-tests} 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
python3 scripts/make_bench_data.py --out data/bench --rows ${ROWS:-256} >/dev/null
for spec in "$@"; do
  name=${spec%%:*}; args=${spec#*:}
  echo "=== $name: $args"
  # shellcheck disable=SC2086
  timeout ${RUN_TIMEOUT:-400} python3 scripts/bench_train.py --config ${CONFIG:-configs/llama3.1-8b-4adapters.yaml} \
    --rows ${ROWS:-256} --steps ${STEPS:-6} --warmup ${WARMUP:-2} --out /tmp/bench_$name $args > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -v "^{" "$OUT/$name.log" | tail -${TAIL:-25}; tail -1 "$OUT/$name.log" > "$OUT/$name.json"
done
