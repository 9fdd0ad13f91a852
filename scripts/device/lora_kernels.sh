#!/usr/bin/env bash
# The LoRA kernels on one GPU, one call (carry .whl): their GPU tests, then scripts/tune_kernels.py at the 8B's
# linears (qkv 4096->6144, proj 4096->4096, fc1 4096->28672, fc2 14336->4096) with four adapter segments of
# their per-call ranks under PEFT's layout (an r=16 adapter is rank 48 on the fused q/k/v linear, 32 on the
# fused gate/up one): four r=16 at 32,768 tokens, four r=16 at 16,384, three r=16 and one r=64 at 32,768
# (it brings new rank blocks, hence the most compiles), one r=64 adapter over all 32,768 (its buckets are the
# r=64 block's of the case before: timed before/after, not tuned again).
# Each kernel's config of today is timed first at every bucket; per linear and kernel the summary has the
# launcher's time "before" (the shipped configs, every adapter at the largest rank block in one launch, dS and
# dB in one pass) and "after" (the tuned configs, one launch per rank block), measured in the same run;
# shrink and da_dx are also timed without dropout (the mask's share).
#   bash scripts/device/lora_kernels.sh
#   GPU_TESTS=0, TUNE_TIMEOUT (175 s), REP_MS (20: do_bench's window per candidate)
# Writes $OUT/tuned-<gpu>.json (paste into lorafusion/kernels/tuning.py), $OUT/lora-kernels.json (before/after
# per case and kernel, the no-dropout times, every tuned row), $OUT/tune.log, $OUT/gpu_tests.log.
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\{3\}' | tr 'H' 'h')
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 60 "$PY" -m pytest -q -p no:cacheprovider -x tests/kernels/test_kernel_gpu.py \
    tests/kernels/test_kernel_fused_multi_lora.py \
    tests/kernels/test_kernel_rank_classes.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
fi
shapes=()
for spec in "32768 48,48,48,48 16,16,16,16 32,32,32,32" "16384 48,48,48,48 16,16,16,16 32,32,32,32" \
            "32768 48,48,48,192 16,16,16,64 32,32,32,128" "32768 192 64 128"; do
  read -r m qkv small fc1 <<< "$spec"
  shapes+=("$m,4096,6144@$qkv" "$m,4096,4096@$small" "$m,4096,28672@$fc1" "$m,14336,4096@$small")
done
timeout "${TUNE_TIMEOUT:-175}" "$PY" scripts/tune_kernels.py --kernels lowrank,shrink,ds_db,da_dx \
  --shapes "${shapes[@]}" --mask-cost --rep-ms "${REP_MS:-20}" \
  --out "$OUT/tuned-${gpu:-gpu}.json" --summary "$OUT/lora-kernels.json" > "$OUT/tune.log" 2>&1
echo "tune rc=$?"
grep -E "best|: before|no dropout|wrote|Error" "$OUT/tune.log" | tail -60
