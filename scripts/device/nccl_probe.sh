#!/usr/bin/env bash
# The GPUs' links and NCCL's bandwidth between the GPUs this script may use (CUDA_VISIBLE_DEVICES), in seconds:
#   bash scripts/device/nccl_probe.sh        -> $OUT/nccl_probe.log: nvidia-smi topo -m, NCCL's transport lines, GB/s
set -uo pipefail
. "$(dirname "$0")/multi_gpu.sh"  # $OUT, $PY, the carried wheels, NCCL settings, $NGPU, $BENCH_COMMIT
{
  nvidia-smi topo -m
  NCCL_DEBUG=INFO "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" scripts/nccl_probe.py \
    > /tmp/nccl_probe.raw 2>&1
  grep -E '^\{' /tmp/nccl_probe.raw                        # the bandwidths first
  grep -E 'via |NCCL version' /tmp/nccl_probe.raw | head -12  # then the transport NCCL chose
} > "$OUT/nccl_probe.log" 2>&1
cat "$OUT/nccl_probe.log"
