#!/usr/bin/env bash
# The user path on a GPU, one device call (carry .whl): the quickstart trained on the GPU (Triton kernels, the random base
# drawn on CUDA), then `lorafusion generate` (adapters + base in one batch, KV cache), `export --base` and
# `export --job countdown --merged`, checked against transformers + PEFT on the same GPU (scripts/check_use.py), and
# the generation/export tests run with CUDA visible.
#   run (kind nvidia-h100-x1 or nvidia-h200):  bash scripts/device/use.sh
# Writes $OUT/use.log, $OUT/generated.jsonl, $OUT/check.json.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
RUN=/tmp/use-run
{
  rm -rf "$RUN" /tmp/use-base /tmp/use-merged
  "$PY" -m lorafusion.cli train configs/quickstart.yaml output_dir="$RUN" logging.progress=false \
    logging.tensorboard=false || exit 1
  printf '%s\n' '{"prompt": "countdown 5=", "job": "countdown"}' '{"prompt": "after e=", "job": "successor"}' \
    '{"prompt": "countdown 7=", "job": "countdown"}' '{"prompt": "countdown 3="}' > /tmp/use-prompts.jsonl
  "$PY" -m lorafusion.cli generate "$RUN" --prompts /tmp/use-prompts.jsonl --out "$OUT/generated.jsonl" \
    --max-new-tokens 16 || exit 1
  "$PY" -m lorafusion.cli export "$RUN" --base --out /tmp/use-base || exit 1
  "$PY" -m lorafusion.cli export "$RUN" --job countdown --merged --out /tmp/use-merged || exit 1
  "$PY" scripts/check_use.py "$RUN" --base /tmp/use-base --merged /tmp/use-merged --job countdown \
    --generated "$OUT/generated.jsonl" > "$OUT/check.json"; echo "check exit $?"; cat "$OUT/check.json"
  "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_generate.py tests/export/test_hf.py 2>&1 | tail -15
} 2>&1 | grep -v "Warning\|warnings.warn" | tail -60 | tee "$OUT/use.log"
