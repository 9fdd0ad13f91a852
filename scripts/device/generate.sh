#!/usr/bin/env bash
# Decoding speed on a GPU, one device call (carry .whl): the static decode step's GPU tests (CUDA graph replay = eager,
# and generate's own tests; `--decode auto` takes the graph on CUDA: static_decode.GRAPH_BY_DEFAULT), then decoding speed of `lorafusion generate`
# (generate_ids, after a warm-up): the 8B shape (random bf16 weights, one r=16 adapter) on 8 prompts beside
# transformers + PEFT generate on the same weights and adapter; then the tiny quickstart model on the held-out
# prompts (70 rows, 3 adapters) and on the first 4, beside the dynamic step (no graph).
#   run (kind nvidia-h100-x1):  bash scripts/device/generate.sh
#   SKIP_TESTS=1, SKIP_TINY=1, SKIP_8B=1; NEW_8B (128), REPEATS_8B (2), ALSO_REF_8B=1 (our torch-LoRA path too),
#   DECODE (graph), TESTS_TIMEOUT (120 s)
# Writes $OUT/generate-*.json, $OUT/gpu_tests.log and $OUT/generate.log.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
B="$PY scripts/bench_generate.py --decode ${DECODE:-graph}"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "${TESTS_TIMEOUT:-120}" "$PY" -m pytest -q -p no:cacheprovider -W "error::lorafusion.inference.static_decode.GraphCaptureWarning" \
      tests/inference/test_static_decode.py tests/inference/test_generate.py > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -25 "$OUT/gpu_tests.log"
  fi
  if [ -z "${SKIP_8B:-}" ]; then
    $B --model llama3.1-8b --batch 8 --prompt-len 64-256 --new-tokens "${NEW_8B:-128}" --repeats "${REPEATS_8B:-2}" \
      --hf ${ALSO_REF_8B:+--also-reference} --skip-syncs --out "$OUT/generate-8b-8.json" || echo "8b failed"
  fi
  if [ -z "${SKIP_TINY:-}" ]; then
    $B --model tiny-llama --dtype float32 --prompts configs/quickstart/heldout.jsonl --batch 0 --new-tokens 64 \
      --also-batch 4 --also-dynamic --skip-syncs --out "$OUT/generate-tiny.json" > /dev/null || echo "tiny failed"
    grep -A3 '"tokens_per_s"\|capture_warnings\|rows_same\|speedup' "$OUT/generate-tiny.json" | head -40
  fi
} 2>&1 | grep --line-buffered -v "Warning\|warnings.warn" | tee "$OUT/generate.log" | tail -80
