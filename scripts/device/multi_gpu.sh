# Sourced by the multi-GPU device scripts (scale.sh, tp_overlap.sh, interleaved_check.sh, nccl_probe.sh):
# setup.sh's $OUT, $PY and carried wheels; NVLink multicast off (NCCL's NVLS, torch's symmetric memory);
# $NGPU (the GPUs this process may use); their names printed; $BENCH_COMMIT (and $COMMIT), from the
# checkout unless given: the copied tree may carry no git history.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BENCH_COMMIT=$COMMIT
