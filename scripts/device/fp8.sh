#!/usr/bin/env bash
# Issue 23 (FP8 frozen base) on one GPU, one device call (carry .whl):
#   1. the gpu-marked FP8 tests;
#   2. scripts/check_fp8.py: per-layer output / input-gradient error and GEMM times on the 8B shapes, every LoRA
#      gradient of the 8B model with the bf16 base vs the same model quantized (cosine), base-weight bytes;
#   3. scripts/bench_train.py on configs/llama3.1-8b-4adapters.yaml: bf16 and fp8 at token_capacity $CAP, then fp8
#      at $BIG (what the freed memory allows), one process each, one after the other;
#   4. the quickstart (configs/quickstart.yaml, model.dtype=bfloat16) trained with a bf16 and an fp8 base (both at
#      once: tiny), then `lorafusion generate` on the same prompts, and `export --merged` of the fp8 run.
#   run (kind nvidia-h100-x1):  bash scripts/device/fp8.sh
# Writes $OUT/*.log, $OUT/*.json.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
CAP=${CAP:-12288}; BIG=${BIG:-13824}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
T0=$SECONDS
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_linear.py tests/test_fp8_base.py 2>&1 \
  | grep -v "Warning\|warn" | tail -25 > "$OUT/gpu_tests.log"; tail -3 "$OUT/gpu_tests.log"; echo "tests $((SECONDS-T0))s"
timeout 200 "$PY" scripts/check_fp8.py --out "$OUT/fp8_quality.json" > "$OUT/quality.log" 2>&1
echo "quality rc=$? $((SECONDS-T0))s"; grep -v "^linear\|^model" "$OUT/quality.log" | grep -v -i warn | tail -5
"$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
for spec in "bf16:$CAP:bf16:6" "fp8:$CAP:fp8:6" "fp8big:$BIG:fp8:4"; do
  IFS=: read -r name cap prec steps <<< "$spec"
  timeout 170 "$PY" scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml --rows 256 --steps "$steps" \
    --warmup 2 --skip-hf --out "/tmp/bench_$name" scheduler.token_capacity="$cap" model.base_precision="$prec" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS-T0))s"; tail -1 "$OUT/$name.log" > "$OUT/$name.json"
  grep -i "tokens/s\|error\|Traceback" "$OUT/$name.log" | head -5
done
printf '%s\n' '{"prompt": "count 5=", "job": "count"}' '{"prompt": "after e=", "job": "successor"}' \
  '{"prompt": "count 7=", "job": "count"}' '{"messages": [{"role": "user", "content": "kitab"}], "job": "vowel"}' '{"prompt": "count 3="}' \
  > /tmp/fp8-prompts.jsonl
qs() {  # $1 = bf16 | fp8
  rm -rf "/tmp/qs-$1"
  timeout 200 "$PY" -m lorafusion.cli train configs/quickstart.yaml output_dir="/tmp/qs-$1" model.dtype=bfloat16 \
    model.base_precision="$1" logging.progress=false logging.tensorboard=false > "$OUT/qs-$1.log" 2>&1 || return 1
  cp "/tmp/qs-$1/summary.json" "$OUT/qs-$1-summary.json"
  "$PY" -m lorafusion.cli generate "/tmp/qs-$1" --prompts /tmp/fp8-prompts.jsonl --out "$OUT/qs-$1-generated.jsonl" \
    --max-new-tokens 16 >> "$OUT/qs-$1.log" 2>&1
}
qs bf16 & qs fp8; wait
"$PY" -m lorafusion.cli export /tmp/qs-fp8 --job count --merged --out /tmp/qs-fp8-merged >> "$OUT/qs-fp8.log" 2>&1
echo "quickstart $((SECONDS-T0))s"; grep -v -i "warn" "$OUT/qs-bf16.log" "$OUT/qs-fp8.log" | grep "loss\|generated\|exported\|rror" | head -20
