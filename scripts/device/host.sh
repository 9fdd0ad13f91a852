#!/usr/bin/env bash
# Host time per microbatch on the GPU (scripts/bench_host.py: the config's own model, capacity 4096, the
# functions with most own and cumulative time under cProfile), in one call (carry .whl: setup.sh):
#   bash scripts/device/host.sh NAME NPROC [BENCH_HOST_ARGS...]
#   bash scripts/device/host.sh tp2 2 parallelism.tp=2 parallelism.sequence_parallel=true
# Output: $OUT/host_NAME.log; its summary and profile are printed.
set -uo pipefail
. "$(dirname "$0")/multi_gpu.sh"  # $OUT, $PY, the carried wheels, NCCL settings, $NGPU, $BENCH_COMMIT
name=$1; nproc=$2; shift 2
log=$OUT/host_$name.log
# shellcheck disable=SC2086
bash scripts/device/watch.sh "${RUN_TIMEOUT:-240}" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
  scripts/bench_host.py --cprofile "${TOP:-45}" "$@" > "$log" 2>&1
echo "rc=$?"
grep -v "^{" "$log" | sed -n '/^host:/,$p' | grep -v "^\s*$" | head -"${LINES_OUT:-110}"
