#!/usr/bin/env bash
# Issue 28 on a GPU, one device call (carry .whl): decoding speed of `lorafusion generate` (generate_ids, after a
# warm-up) — the tiny quickstart model on the held-out prompts (70 rows, 3 adapters) and on the first 4, and
# the 8B shape (random bf16 weights, one r=16 adapter) on 8 prompts beside transformers + PEFT generate on the
# same weights and adapter; device-to-host syncs per decode step counted.
#   run (kind nvidia-h100-x1):  bash scripts/device/generate.sh            SKIP_8B=1: the tiny model only; SKIP_TINY=1, NEW_8B, REPEATS_8B
# Writes $OUT/generate-*.json, $OUT/profile-*.txt and $OUT/generate.log.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
B="$PY scripts/bench_generate.py"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  if [ -z "${SKIP_TINY:-}" ]; then
    $B --model tiny-llama --dtype float32 --prompts configs/quickstart/heldout.jsonl --batch 0 --new-tokens 64 \
      --also-batch 4 --profile "$OUT/profile-tiny.txt" --out "$OUT/generate-tiny.json" || echo "tiny failed"
  fi
  if [ -z "${SKIP_8B:-}" ]; then
    $B --model llama3.1-8b --batch 8 --prompt-len 64-256 --new-tokens "${NEW_8B:-128}" --repeats "${REPEATS_8B:-3}" \
      --hf --also-reference --skip-syncs --out "$OUT/generate-8b-8.json" || echo "8b failed"
  fi
} 2>&1 | grep --line-buffered -v "Warning\|warnings.warn" | tee "$OUT/generate.log" | tail -40
