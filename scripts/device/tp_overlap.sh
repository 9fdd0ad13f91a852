#!/usr/bin/env bash
# Tensor-parallel overlap on vs off, in one call on a machine with 2 GPUs (carry .whl: setup.sh):
#   bash scripts/device/tp_overlap.sh            # 8B shape, TP=2 + sequence parallel, 4 adapters
#   MODEL=32b bash scripts/device/tp_overlap.sh  # the 32B shape (configs/qwen2.5-32b-4adapters.yaml)
# One training run (scripts/bench_tp_overlap.py under torchrun): the model is built once and its planned chunks
# alternate between parallelism.tp_overlap off and on (NANO: nano-batch counts, "2"; they matter without SP),
# after one warm-up chunk per mode: TIMED (6) timed chunks per mode, the order reversed every other round; then
# (PROFILE=1) one profiled chunk per mode: the NCCL collectives' time and the part of it hidden under compute
# kernels, per rank. Capacity CAPACITY (4096) tokens, LOOKAHEAD (2) global batches per job per chunk.
# Writes $OUT/tp-overlap-2x<gpu>.json (tokens/s per mode, speedup over off, chunk times, profile, device,
# commit, command) and $OUT/tp-overlap.log; the GPU test of the overlapped linears (NCCL, 2 GPUs) first into
# $OUT/gpu_tests.log (GPU_TESTS=0 skips it). Pass BENCH_COMMIT=$(git rev-parse --short HEAD) from the checkout.
set -uo pipefail
. "$(dirname "$0")/multi_gpu.sh"  # $OUT, $PY, the carried wheels, NCCL settings, $NGPU, $BENCH_COMMIT
if [ "${GPU_TESTS:-1}" = 1 ] && [ "$NGPU" -ge 2 ]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_tp_overlap.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
fi
case "${MODEL:-8b}" in  # (CONFIG: another config; the CPU plumbing test runs the quickstart on gloo)
  8b)  config=${CONFIG:-configs/llama3.1-8b-4adapters.yaml} ;;
  32b) config=${CONFIG:-configs/qwen2.5-32b-4adapters.yaml} ;;
  *) echo "MODEL: expected 8b or 32b, got $MODEL"; exit 2 ;;
esac
# the GPU's model in the file name ("NVIDIA H100 80GB HBM3" -> h100; no GPU: cpu)
gpu=$("$PY" -c 'import re, torch
n = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
m = re.search(r"\b([A-Za-z]+\d{2,4})\b", n.replace("NVIDIA", ""))
print((m.group(1) if m else n.split()[-1]).lower())')
name=${NAME:-tp-overlap-2x${gpu}}
[ "${MODEL:-8b}" = 8b ] || name="$name-${MODEL}"
prof=""; [ "${PROFILE:-1}" = 1 ] && prof="--profile"
cmd="$PY -m torch.distributed.run --standalone --nproc_per_node 2 scripts/bench_tp_overlap.py --config $config \
--nano ${NANO:-2} --timed ${TIMED:-6} $prof --rows ${ROWS:-1024} --out ${BENCH_TMP:-/tmp}/bench_tp_overlap --json $OUT/$name.json \
parallelism.tp=2 parallelism.pp=1 parallelism.sequence_parallel=true scheduler.token_capacity=${CAPACITY:-4096} \
scheduler.lookahead_batches=${LOOKAHEAD:-2} ${EXTRA:-}"
echo "=== $name: $cmd"
rm -rf "${BENCH_TMP:-/tmp}/bench_tp_overlap"
# shellcheck disable=SC2086
BENCH_COMMAND="$cmd" bash scripts/device/watch.sh "${RUN_TIMEOUT:-540}" $cmd > "$OUT/tp-overlap.log" 2>&1
rc=$?; echo "rc=$rc"
grep -v "^{" "$OUT/tp-overlap.log" | grep -v "Warning\|warn(" | tail -"${TAIL:-30}"
exit $rc
