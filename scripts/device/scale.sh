#!/usr/bin/env bash
# Multi-GPU training runs, each reproducible in one call on a machine of its GPU count (carry .whl: setup.sh):
#   bash scripts/device/scale.sh                 # every run whose GPU count is this machine's
#   bash scripts/device/scale.sh 70b-pp4         # chosen runs (a 70B run takes ~5-6 minutes)
# Runs (GPUs, config, layout; random bf16 weights, mixed-length data from scripts/make_bench_data.py); the shipped
# configs' `auto` settings (capacity, recompute per stage, and for the 70B config the stage split) are resolved
# by the memory plan on the GPU as `lorafusion train` resolves them:
#   8b-pp2-recompute  2  llama3.1-8b   pp=2 + full activation recompute (the routing-restore path), a few steps
#   8b-pp2 / 8b-tp2 / 8b-dp2   2  llama3.1-8b  pp=2 / tp=2 + sequence parallel / dp=2 (the scaling table; 8b-1gpu: one GPU)
#   32b-pp2           2  qwen2.5-32b   pp=2, the shipped config
#   32b-pp2-rc        2  qwen2.5-32b   pp=2, recompute of RC_LAYERS (16) of each stage's 32 layers; SPLIT=[33,31]
#   32b-tp2sp         2  qwen2.5-32b   tp=2 + sequence parallel
#   70b-pp4           4  llama3.1-70b  pp=4, the shipped config (stage_layers and recompute balanced together)
#   70b-pp4-fp8       4  llama3.1-70b  the same with model.base_precision=fp8
#   70b-pp4-la16      4  llama3.1-70b  pp=4, lookahead 16 (chunks twice the shipped config's; no baselines)
#   70b-tp2pp2        4  llama3.1-70b  tp=2 + sequence parallel, pp=2
#   70b-pp4-v2/-v5    4  llama3.1-70b  pp=4 x 2 / 5 virtual stages (interleaved 1F1B), loss-aware split, recompute auto
#   70b-dp2pp4        8  llama3.1-70b  dp=2 x pp=4                (no baselines: scaling vs 70b-pp4)
#   70b-dp2tp2pp2     8  llama3.1-70b  dp=2 x tp=2 (+SP) x pp=2   (scaling vs 70b-tp2pp2)
# Each run: STEPS optimizer steps per job, the first WARMUP untimed (whole chunks of the config's lookahead_batches),
# >= 8 timed; then, unless BASELINES=0, the same data one adapter at a time through our runtime with a pipeline
# flush per global batch (scheduler off, the Megatron-LM way) and with kernels=reference (fused kernels off);
# BASELINE_SET=scheduler_off keeps only the first.
# Writes $OUT/<run>.json (docs/results/70b-4xh100.json's shape: tokens_per_s, bubble_ratio (steady state, timed
# chunks only) and per rank, steps_per_job, peak_mem_gib per rank with the predicted beside it, reserved and
# outside-torch memory per rank, device, commit, command, baselines) and $OUT/<run>.log; GPU tests first
# (GPU_TESTS=0 skips them) into $OUT/gpu_tests.log. Pass BENCH_COMMIT=$(git rev-parse --short HEAD) from the
# checkout: the copied tree may carry no git history. BENCH_ARGS: more bench_train.py options (e.g. --profile:
# the top kernels of the first timed chunk on rank 0).
set -uo pipefail
. "$(dirname "$0")/multi_gpu.sh"  # $OUT, $PY, the carried wheels, NCCL settings, $NGPU, $BENCH_COMMIT
STEPS=${STEPS:-12}; WARMUP=${WARMUP:-4}; ROWS=${ROWS:-256}

if [ "${GPU_TESTS:-1}" = 1 ] && [ "$NGPU" -ge 1 ]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_PATHS:-tests/models/test_recompute.py tests/kernels} 2>&1 \
    | tail -15 | tee "$OUT/gpu_tests.log"
fi
# (bench_train.py makes data/bench on rank 0 when a config reads it)

# name -> "GPUS CONFIG STEPS WARMUP BASELINES OVERRIDES..."
spec() {
  case "$1" in
    8b-pp2-recompute) echo "2 configs/llama3.1-8b-4adapters.yaml 4 2 0 parallelism.pp=2 model.recompute=true" ;;
    32b-pp2)          echo "2 configs/qwen2.5-32b-4adapters.yaml $STEPS $WARMUP 1 parallelism.tp=1 parallelism.pp=2" ;;
    # recompute only the first RC_LAYERS (16) of each stage's 32 layers: the PP=2 run leaves 100 GiB a GPU unused;
    # SPLIT (e.g. [33,31]) moves layers off the last stage, which also holds the output layer and the loss
    32b-pp2-rc)       echo "2 configs/qwen2.5-32b-4adapters.yaml $STEPS $WARMUP 0 parallelism.tp=1 parallelism.pp=2 model.recompute_layers=${RC_LAYERS:-16}${SPLIT:+ parallelism.stage_layers=$SPLIT}" ;;
    32b-tp2sp)        echo "2 configs/qwen2.5-32b-4adapters.yaml $STEPS $WARMUP 1 parallelism.tp=2 parallelism.pp=1 parallelism.sequence_parallel=true" ;;
    # (the config's lookahead_batches is 8: 16 steps = one warm-up chunk + one timed chunk of 8 steps)
    70b-pp4)          echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 1 parallelism.tp=1 parallelism.pp=4" ;;
    # the lever measured on 32B PP=2 (lookahead 2 -> 4: bubble 0.100 -> 0.080): chunks twice as long again, the
    # pipeline's fill and drain half as often (one warm-up chunk + one timed chunk of 16 steps; baselines as 70b-pp4)
    8b-1gpu)          echo "1 configs/llama3.1-8b-4adapters.yaml 8 4 0 scheduler.token_capacity=4096 scheduler.lookahead_batches=4" ;;
    8b-pp2)           echo "2 configs/llama3.1-8b-4adapters.yaml 8 4 0 parallelism.pp=2 scheduler.token_capacity=4096 scheduler.lookahead_batches=4" ;;
    8b-tp2)           echo "2 configs/llama3.1-8b-4adapters.yaml 8 4 0 parallelism.tp=2 parallelism.sequence_parallel=true scheduler.token_capacity=4096 scheduler.lookahead_batches=4" ;;
    8b-dp2)           echo "2 configs/llama3.1-8b-4adapters.yaml 8 4 0 parallelism.dp=2 scheduler.token_capacity=4096 scheduler.lookahead_batches=4" ;;
    70b-pp4-fp8)      echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 model.base_precision=fp8" ;;
    70b-pp4-la16)     echo "4 configs/llama3.1-70b-4adapters.yaml 32 16 0 parallelism.tp=1 parallelism.pp=4 scheduler.lookahead_batches=16" ;;
    70b-tp2pp2)       echo "4 configs/llama3.1-70b-4adapters.yaml 12 4 1 parallelism.tp=2 parallelism.pp=2 parallelism.sequence_parallel=true scheduler.lookahead_batches=4" ;;
    70b-pp4-v2)       echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 parallelism.virtual_stages=2" ;;
    70b-pp4-v5)       echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 parallelism.virtual_stages=5" ;;
    # 8 GPUs: DP=2 over each 4-GPU layout, parallelism.dp: auto = 8 / (tp*pp); against 70b-pp4 / 70b-tp2pp2
    70b-dp2pp4)       echo "8 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4" ;;
    70b-dp2tp2pp2)    echo "8 configs/llama3.1-70b-4adapters.yaml 12 4 0 parallelism.tp=2 parallelism.pp=2 parallelism.sequence_parallel=true scheduler.lookahead_batches=4" ;;
    # the plumbing on CPU (tests/runtime/test_bench_scale.py: NGPU=2, gloo)
    tiny-pp2)         echo "2 configs/quickstart.yaml 4 2 1 parallelism.pp=2" ;;
    tiny-pp2-v2)      echo "2 configs/quickstart.yaml 4 2 0 parallelism.pp=2 parallelism.virtual_stages=2" ;;
    8b-pp2-v2)        echo "2 configs/llama3.1-8b-4adapters.yaml 8 4 0 parallelism.pp=2 parallelism.virtual_stages=2 scheduler.token_capacity=4096 scheduler.lookahead_batches=4" ;;
    *) return 1 ;;
  esac
}
ALL="8b-1gpu 8b-pp2-recompute 8b-pp2 8b-tp2 8b-dp2 32b-pp2 32b-pp2-rc 32b-tp2sp 70b-pp4 70b-pp4-fp8 70b-pp4-la16 70b-tp2pp2 70b-pp4-v2 70b-pp4-v5 70b-dp2pp4 70b-dp2tp2pp2"
RUNS=${*:-}
if [ -z "$RUNS" ]; then  # every run whose GPU count is the machine's
  for r in $ALL; do read -r g _ <<<"$(spec "$r")"; [ "$g" = "$NGPU" ] && RUNS="$RUNS $r"; done
fi
status=0
for name in $RUNS; do
  s=$(spec "$name") || { echo "unknown run $name (known: $ALL)"; status=2; continue; }
  read -r gpus config steps warmup baselines overrides <<<"$s"
  if [ "$gpus" -gt "$NGPU" ]; then echo "=== $name: needs $gpus GPUs, $NGPU here: skipped"; continue; fi
  # baselines: scheduler off (one job at a time, a flush per global batch) first, then fused kernels off; one
  # warm-up chunk and BASELINE_TIMED (2) timed steps per job each, so a 70B run and its baselines fit one call
  extra=""; [ "$baselines" = 1 ] && [ "${BASELINES:-1}" = 1 ] && \
    extra="--ablate --flush-per-batch --baselines ${BASELINE_SET:-scheduler_off,reference} --baseline-timed-steps ${BASELINE_TIMED:-2}"
  # shellcheck disable=SC2086
  cmd="$PY -m torch.distributed.run --standalone --nproc_per_node $gpus scripts/bench_train.py --config $config \
--rows $ROWS --steps $steps --warmup $warmup --out ${BENCH_TMP:-/tmp}/bench_$name $extra --scale-json $OUT/$name.json \
${BENCH_ARGS:-} $overrides"
  echo "=== $name: $cmd"
  rm -rf "${BENCH_TMP:-/tmp}/bench_$name"
  BENCH_COMMAND="$cmd" bash scripts/device/watch.sh "${RUN_TIMEOUT:-560}" $cmd > "$OUT/$name.log" 2>&1  # a hang: stacks, then 124
  rc=$?; echo "rc=$rc"; [ $rc = 0 ] || status=1
  grep -v "^{" "$OUT/$name.log" | tail -"${TAIL:-20}"
done
exit $status
