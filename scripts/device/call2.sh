#!/usr/bin/env bash
# one device call (nvidia-h200-x4): 70B PP=4 (no recompute, 4,096-token microbatches, lookahead 4) with the
# scheduler-off (one job at a time, a flush per global batch) and fused-off baselines
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site BENCH_COMMIT=${BENCH_COMMIT:-unknown}
python3 scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
CAP=${CAP:-4096}
cmd="python3 -m torch.distributed.run --standalone --nproc_per_node 4 scripts/bench_train.py --config configs/llama3.1-70b-4adapters.yaml --rows 256 --steps 12 --warmup 4 --skip-hf --out /tmp/d --scale-json $OUT/70b-pp4.json --ablate --flush-per-batch --baselines scheduler_off,reference --baseline-timed-steps 2 parallelism.tp=1 parallelism.pp=4 model.recompute=false scheduler.token_capacity=$CAP scheduler.lookahead_batches=4"
echo "$cmd"
BENCH_COMMAND="$cmd" bash scripts/device/watch.sh $((575 - SECONDS)) $cmd > $OUT/70b-pp4.log 2>&1
echo "rc=$? after ${SECONDS}s"
grep -v "^ *warnings.warn\|UserWarning\|^{" $OUT/70b-pp4.log | tail -12
