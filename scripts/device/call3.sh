#!/usr/bin/env bash
# one device call (nvidia-h200-x4): 70B TP=2 x PP=2 with sequence parallelism, then PP=4 with lookahead 8
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site BENCH_COMMIT=${BENCH_COMMIT:-unknown}
python3 scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
B="python3 -m torch.distributed.run --standalone --nproc_per_node 4 scripts/bench_train.py --config configs/llama3.1-70b-4adapters.yaml --rows 256 --skip-hf"; O="model.recompute=false scheduler.token_capacity=4096"
cmd="$B --steps 12 --warmup 4 --out /tmp/e --scale-json $OUT/70b-tp2pp2.json parallelism.tp=2 parallelism.pp=2 parallelism.sequence_parallel=true scheduler.lookahead_batches=4 $O"
BENCH_COMMAND="$cmd" bash scripts/device/watch.sh 270 $cmd > $OUT/70b-tp2pp2.log 2>&1
echo "tp2pp2 rc=$? after ${SECONDS}s"; grep -v "^ *warnings.warn\|UserWarning\|^{" $OUT/70b-tp2pp2.log | tail -4
cmd="$B --steps 16 --warmup 8 --out /tmp/f --scale-json $OUT/70b-pp4-la8.json parallelism.tp=1 parallelism.pp=4 scheduler.lookahead_batches=8 $O"
BENCH_COMMAND="$cmd" bash scripts/device/watch.sh $((580 - SECONDS)) $cmd > $OUT/70b-pp4-la8.log 2>&1
echo "pp4 la8 rc=$? after ${SECONDS}s"; grep -v "^ *warnings.warn\|UserWarning\|^{" $OUT/70b-pp4-la8.log | tail -4
