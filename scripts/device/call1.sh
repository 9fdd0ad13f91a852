#!/usr/bin/env bash
# one device call (nvidia-h200-x4): PP=2 hang diagnosis on two GPU pairs at once, then 70B PP=4 if they pass
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site BENCH_COMMIT=${BENCH_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
W="bash scripts/device/watch.sh"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m lorafusion.cli train configs/llama3.1-8b-4adapters.yaml parallelism.pp=2 scheduler.token_capacity=4096 logging.tensorboard=false"
S="jobs.0.max_steps=4 jobs.1.max_steps=4 jobs.2.max_steps=4 jobs.3.max_steps=4"
t0=$SECONDS
CUDA_VISIBLE_DEVICES=0,1 $W 200 $TR $S output_dir=/tmp/a > $OUT/a_pp2.log 2>&1 & pa=$!
CUDA_VISIBLE_DEVICES=2,3 $W 200 $TR $S model.recompute=true output_dir=/tmp/b > $OUT/b_pp2_recompute.log 2>&1 & pb=$!
wait $pa; ra=$?; wait $pb; rb=$?
echo "a (pp2) rc=$ra  b (pp2 recompute) rc=$rb  after $((SECONDS - t0))s"
tail -5 $OUT/a_pp2.log; tail -5 $OUT/b_pp2_recompute.log
if [ $ra != 0 ] || [ $rb != 0 ]; then
  echo "=== c: bench_train --no-background (no planning thread, no gloo group)"
  CUDA_VISIBLE_DEVICES=0,1 $W 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 scripts/bench_train.py \
    --config configs/llama3.1-8b-4adapters.yaml --rows 256 --steps 4 --warmup 2 --skip-hf --no-background --out /tmp/c \
    parallelism.pp=2 scheduler.token_capacity=4096 model.recompute=true > $OUT/c_nobg.log 2>&1
  echo "c rc=$?"; grep -v "^ *warnings.warn\|UserWarning" $OUT/c_nobg.log | tail -5
  exit 0
fi
echo "=== 70b pp4 (no recompute, cap 4096, lookahead 4)"
$W $((560 - SECONDS)) python3 -m torch.distributed.run --standalone --nproc_per_node 4 scripts/bench_train.py \
  --config configs/llama3.1-70b-4adapters.yaml --rows 256 --steps 12 --warmup 4 --skip-hf --out /tmp/d \
  --scale-json $OUT/70b-pp4.json parallelism.tp=1 parallelism.pp=4 model.recompute=false \
  scheduler.token_capacity=4096 scheduler.lookahead_batches=4 > $OUT/70b-pp4.log 2>&1
echo "70b rc=$?"; grep -v "^ *warnings.warn\|UserWarning" $OUT/70b-pp4.log | tail -25
