#!/usr/bin/env bash
# The multi-GPU runs of issues 10, 15 and 16, each reproducible in one device call (same wheels as speed.sh, carry .whl):
#   run (kind nvidia-h200-x2):  bash scripts/device/scale.sh                     # every run that fits the GPUs present
#   run (kind nvidia-h200-x2):  bash scripts/device/scale.sh 32b-pp2             # chosen runs (one per call fits 10 min)
#   run (kind nvidia-h200-x4):  bash scripts/device/scale.sh 70b-pp4       # then 70b-tp2pp2 in a second call
#   run (kind nvidia-h200-x4):  bash scripts/device/scale.sh 70b-pp4-auto 70b-pp4-v2   # then 70b-pp4-v5 (issue 27)
#   run (kind nvidia-h200-x8):  bash scripts/device/scale.sh 70b-dp2pp4    # then 70b-dp2tp2pp2 in a second call
# Runs (GPUs, config, layout; random bf16 weights, mixed-length data from scripts/make_bench_data.py):
#   8b-pp2-recompute  2  llama3.1-8b   pp=2 + full activation recompute (the routing-restore path), a few steps
#   32b-pp2           2  qwen2.5-32b   pp=2                     4 adapters r=16 all-linear
#   32b-pp2-rc        2  qwen2.5-32b   pp=2, recompute of RC_LAYERS (16) of each stage's 32 layers only; SPLIT=[33,31]
#                                      also moves a layer from the last stage to the first
#   32b-tp2sp         2  qwen2.5-32b   tp=2 + sequence parallel
#   70b-pp4           4  llama3.1-70b  pp=4
#   70b-pp4-la16      4  llama3.1-70b  pp=4, lookahead 16 (chunks twice the shipped config's; no baselines)
#   70b-tp2pp2        4  llama3.1-70b  tp=2 + sequence parallel, pp=2
#   70b-pp4-auto      4  llama3.1-70b  pp=4, loss-aware split (stage_layers auto: 20/21/21/18)      (issue 27)
#   70b-pp4-v2        4  llama3.1-70b  pp=4 x 2 virtual stages (interleaved 1F1B), auto split,      (issue 27)
#                                      recompute of VRC (4) layers of each chunk (stage 0 would need ~164 GiB)
#   70b-pp4-v5        4  llama3.1-70b  pp=4 x 5 virtual stages, auto split, VRC5 (1) of each 4-layer chunk (issue 27)
#   70b-dp2pp4        8  llama3.1-70b  dp=2 x pp=4                (issue 16; no baselines: scaling vs 70b-pp4)
#   70b-dp2tp2pp2     8  llama3.1-70b  dp=2 x tp=2 (+SP) x pp=2   (issue 16; scaling vs 70b-tp2pp2)
# Each 32B run: STEPS (default 12) optimizer steps per job, the first WARMUP (4) untimed, so >= 8 timed (the config's
# lookahead_batches is 4: one warm-up chunk, two timed chunks; 70B: see its spec);
# then, unless BASELINES=0, the same data one adapter at a time through our runtime with a pipeline flush per
# global batch (scheduler off, the Megatron-LM way) and with kernels=reference (fused kernels off).
# Writes $OUT/<run>.json (the docs/results/32b-pp2-2gpu.json shape: tokens_per_s, bubble_ratio (steady state,
# timed chunks only), steps_per_job, peak_mem_gib per rank, device, commit, command, baselines) and
# $OUT/<run>.log; GPU tests first (GPU_TESTS=0 skips them) into $OUT/gpu_tests.log. At most 8 files come
# back from $OUT: with the GPU tests that is 3 runs per call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BENCH_COMMIT=$COMMIT
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
    70b-pp4-fp8)      echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 model.base_precision=fp8" ;;
    70b-pp4-la16)     echo "4 configs/llama3.1-70b-4adapters.yaml 32 16 0 parallelism.tp=1 parallelism.pp=4 scheduler.lookahead_batches=16" ;;
    70b-tp2pp2)       echo "4 configs/llama3.1-70b-4adapters.yaml 12 4 1 parallelism.tp=2 parallelism.pp=2 parallelism.sequence_parallel=true scheduler.lookahead_batches=4" ;;
    # issue 27: the simulated steady bubble 0.125 (V=1 even, measured 0.119) -> 0.074 (auto split) -> 0.027 (V=2)
    # -> 0.023 (V=5) (docs/results/pipeline-interleaved-sim.json); one warm-up + one timed chunk, no baselines
    # (against 70b-pp4). Interleaving holds more activations on stage 0 (memory model: 164 GiB at V=2 without
    # recompute): VRC / VRC5 layers of each model chunk are recomputed (the model: stage 0 at 117 / 119 GiB)
    70b-pp4-auto)     echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 parallelism.stage_layers=auto" ;;
    70b-pp4-v2)       echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 parallelism.virtual_stages=2 parallelism.stage_layers=auto model.recompute=true model.recompute_layers=${VRC:-4}" ;;
    70b-pp4-v5)       echo "4 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4 parallelism.virtual_stages=5 parallelism.stage_layers=auto model.recompute=true model.recompute_layers=${VRC5:-1}" ;;
    # 8 GPUs (issue 16): DP=2 over each 4-GPU layout, parallelism.dp: auto = 8 / (tp*pp); against 70b-pp4 / 70b-tp2pp2
    70b-dp2pp4)       echo "8 configs/llama3.1-70b-4adapters.yaml 16 8 0 parallelism.tp=1 parallelism.pp=4" ;;
    70b-dp2tp2pp2)    echo "8 configs/llama3.1-70b-4adapters.yaml 12 4 0 parallelism.tp=2 parallelism.pp=2 parallelism.sequence_parallel=true scheduler.lookahead_batches=4" ;;
    # the plumbing on CPU (tests/runtime/test_bench_scale.py: NGPU=2, gloo)
    tiny-pp2)         echo "2 configs/quickstart.yaml 4 2 1 parallelism.pp=2" ;;
    *) return 1 ;;
  esac
}
ALL="8b-pp2-recompute 32b-pp2 32b-pp2-rc 32b-tp2sp 70b-pp4 70b-pp4-la16 70b-tp2pp2 70b-pp4-auto 70b-pp4-v2 70b-pp4-v5 70b-dp2pp4 70b-dp2tp2pp2"
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
    extra="--ablate --flush-per-batch --baselines scheduler_off,reference --baseline-timed-steps ${BASELINE_TIMED:-2}"
  # shellcheck disable=SC2086
  cmd="$PY -m torch.distributed.run --standalone --nproc_per_node $gpus scripts/bench_train.py --config $config \
--rows $ROWS --steps $steps --warmup $warmup --out ${BENCH_TMP:-/tmp}/bench_$name $extra --scale-json $OUT/$name.json \
$overrides"
  echo "=== $name: $cmd"
  rm -rf "${BENCH_TMP:-/tmp}/bench_$name"
  BENCH_COMMAND="$cmd" bash scripts/device/watch.sh "${RUN_TIMEOUT:-560}" $cmd > "$OUT/$name.log" 2>&1  # a hang: stacks, then 124
  rc=$?; echo "rc=$rc"; [ $rc = 0 ] || status=1
  grep -v "^{" "$OUT/$name.log" | tail -"${TAIL:-20}"
done
exit $status
