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
# Writes $OUT/run.log, fp8_quality.json, bf16.json, fp8.json, fp8big.json, quickstart.json, logs.tar.gz (every log).
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
CAP=${CAP:-12288}; BIG=${BIG:-13824}; L=/tmp/fp8logs; rm -rf "$L"; mkdir -p "$L"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
T0=$SECONDS
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_linear.py tests/test_fp8_base.py > "$L/gpu_tests.log" 2>&1
grep -v "Warning\|warn" "$L/gpu_tests.log" | tail -12; echo "tests $((SECONDS-T0))s"
timeout 200 "$PY" scripts/check_fp8.py --out "$OUT/fp8_quality.json" > "$L/quality.log" 2>&1
echo "quality rc=$? $((SECONDS-T0))s"; grep -v "^linear\|^model" "$L/quality.log" | grep -v -i warn | tail -5
"$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
for spec in "bf16:$CAP:bf16:6" "fp8:$CAP:fp8:6" "fp8big:$BIG:fp8:4"; do
  IFS=: read -r name cap prec steps <<< "$spec"
  timeout 170 "$PY" scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml --rows 256 --steps "$steps" \
    --warmup 2 --skip-hf --out "/tmp/bench_$name" scheduler.token_capacity="$cap" model.base_precision="$prec" \
    > "$L/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS-T0))s"; tail -1 "$L/$name.log" > "$OUT/$name.json"
  grep -v "^{" "$L/$name.log" | grep -i "tokens/s\|error\|Traceback\|peak\|lorafusion " | head -6
done
printf '%s\n' '{"prompt": "count 5=", "job": "count"}' '{"prompt": "after e=", "job": "successor"}' \
  '{"prompt": "count 7=", "job": "count"}' '{"messages": [{"role": "user", "content": "kitab"}], "job": "vowel"}' \
  '{"prompt": "count 3="}' > /tmp/fp8-prompts.jsonl
qs() {  # $1 = bf16 | fp8
  rm -rf "/tmp/qs-$1"
  timeout 200 "$PY" -m lorafusion.cli train configs/quickstart.yaml output_dir="/tmp/qs-$1" model.dtype=bfloat16 \
    model.base_precision="$1" logging.progress=false logging.tensorboard=false > "$L/qs-$1.log" 2>&1 || return 1
  "$PY" -m lorafusion.cli generate "/tmp/qs-$1" --prompts /tmp/fp8-prompts.jsonl --out "/tmp/qs-$1-generated.jsonl" \
    --max-new-tokens 16 >> "$L/qs-$1.log" 2>&1
}
qs bf16 & qs fp8; wait
"$PY" -m lorafusion.cli export /tmp/qs-fp8 --job count --merged --out /tmp/qs-fp8-merged >> "$L/qs-fp8.log" 2>&1
"$PY" - > "$OUT/quickstart.json" <<'PY'
import json, pathlib
out = {}
for p in ("bf16", "fp8"):
    s, g = pathlib.Path(f"/tmp/qs-{p}/summary.json"), pathlib.Path(f"/tmp/qs-{p}-generated.jsonl")
    out[p] = {"summary": json.loads(s.read_text()) if s.is_file() else None,
              "generated": [json.loads(x) for x in g.read_text().splitlines()] if g.is_file() else None}
print(json.dumps(out, indent=1))
PY
echo "quickstart $((SECONDS-T0))s"
grep -h -v -i "warn" "$L/qs-bf16.log" "$L/qs-fp8.log" | grep "loss\|generated\|exported\|rror" | head -20
tar -czf "$OUT/logs.tar.gz" -C "$L" .
