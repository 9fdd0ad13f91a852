#!/usr/bin/env bash
# The FP8 base's row quantization on one GPU (carry .whl), in one go (about 2-3 minutes):
#   1. the FP8 GPU tests (pytest -m gpu on tests/ops/test_fp8_linear.py and tests/layers/test_fp8_base.py: q
#      and scale bit for bit against the torch path, the forward and input gradient against float64; then
#      tests/ops/test_fp8_lora.py, the FP8 base + LoRA op on CUDA);
#   2. scripts/bench_fp8_quant.py at $TOKENS rows (default 32768, the 8B's auto capacity on an H200): per
#      8B shape the shipped kernel, the former per-element division ("divide") and other launches ($VARIANTS:
#      few (default) or all), each checked bit for bit; per-layer sums and the fastest exact launch per shape.
#   run:  bash scripts/device/fp8_quant.sh      (GPU_TESTS=0: the bench only; on a CPU, TOKENS=4: a dry run)
# Writes under $OUT: run.log, gpu_tests.log, fp8_quant.json.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
L=/tmp/fp8quant_logs; mkdir -p "$L"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
if [ "${GPU_TESTS:-1}" = 1 ]; then
timeout "${TESTS_TIMEOUT:-100}" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/ops/test_fp8_linear.py tests/layers/test_fp8_base.py > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $((SECONDS-T0))s"; tail -3 "$L/gpu_tests.log"
timeout "${LORA_TESTS_TIMEOUT:-90}" "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_fp8_lora.py \
  >> "$L/gpu_tests.log" 2>&1
echo "fp8 LoRA op tests rc=$? $((SECONDS-T0))s"; tail -3 "$L/gpu_tests.log"
grep -v "DEBUG\|^$" "$L/gpu_tests.log" | tail -80 > "$OUT/gpu_tests.log"
fi
timeout "${BENCH_TIMEOUT:-150}" "$PY" scripts/bench_fp8_quant.py --tokens "${TOKENS:-32768}" \
  --variants "${VARIANTS:-few}" --out "$OUT/fp8_quant.json" > "$L/bench.log" 2>&1
echo "bench rc=$? $((SECONDS-T0))s"; grep -v "^{" "$L/bench.log" | tail -12
"$PY" - "$OUT/fp8_quant.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))["fp8_quant"]
print("layer ms:", r.get("layer"), "all exact:", r.get("all_equal"))
PY
echo "done $((SECONDS-T0))s"
