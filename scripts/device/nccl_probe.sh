#!/usr/bin/env bash
# The GPUs' links and NCCL's bandwidth between the GPUs this script may use (CUDA_VISIBLE_DEVICES), in seconds:
#   bash scripts/device/nccl_probe.sh        -> $OUT/nccl_probe.log: nvidia-smi topo -m, NCCL's transport lines, GB/s
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. "$(dirname "$0")/setup.sh"
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
{
  nvidia-smi topo -m
  NCCL_DEBUG=INFO "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" scripts/nccl_probe.py \
    > /tmp/nccl_probe.raw 2>&1
  grep -E '^\{' /tmp/nccl_probe.raw                        # the bandwidths first
  grep -E 'via |NCCL version' /tmp/nccl_probe.raw | head -12  # then the transport NCCL chose
} > "$OUT/nccl_probe.log" 2>&1
cat "$OUT/nccl_probe.log"
