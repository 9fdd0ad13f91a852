#!/usr/bin/env bash
# Where a training step's GPU time goes, in one call (carry .whl: setup.sh):
#   bash scripts/device/profile.sh NAME NPROC [OVERRIDES...]
#   bash scripts/device/profile.sh 8b-tp2 2 parallelism.tp=2 parallelism.sequence_parallel=true
# CONFIG (configs/llama3.1-8b-4adapters.yaml) under torchrun with NPROC processes, capacity CAPACITY (4096),
# one global batch per chunk; the third chunk is profiled on rank 0 (torch.profiler, CUDA activity): the
# GPU's busy fraction over the chunk, its idle gaps, time by kernel family (GEMM, attention, LoRA, NCCL,
# copies, other) and the top kernels. Host synchronisations inside the schedule are counted
# (LORAFUSION_SYNC_DEBUG=warn). Output: $OUT/profile_NAME.log (the summary lines are also printed).
set -uo pipefail
. "$(dirname "$0")/multi_gpu.sh"  # $OUT, $PY, the carried wheels, NCCL settings, $NGPU, $BENCH_COMMIT
name=$1; nproc=$2; shift 2
log=$OUT/profile_$name.log
cmd="$PY -m torch.distributed.run --standalone --nproc_per_node $nproc scripts/bench_train.py \
--config ${CONFIG:-configs/llama3.1-8b-4adapters.yaml} --rows ${ROWS:-256} --steps 3 --warmup 2 --skip-hf --profile \
--out ${BENCH_TMP:-/tmp}/profile_$name scheduler.token_capacity=${CAPACITY:-4096} scheduler.lookahead_batches=1 $*"
echo "=== $name: $cmd" | tee "$log"
# shellcheck disable=SC2086
LORAFUSION_SYNC_DEBUG=warn bash scripts/device/watch.sh "${RUN_TIMEOUT:-300}" $cmd >> "$log" 2>&1
echo "rc=$?"
grep -v "^{" "$log" | sed -n '/^system/,$p' | head -40
grep -h "called a synchronizing" "$log" | sort | uniq -c | sort -rn | head -10 | sed 's/^/host sync inside the schedule: /'
