#!/usr/bin/env bash
# Several device scripts side by side on one multi-GPU machine, each on its own GPUs, in one call:
#   bash scripts/device/together.sh "0,1:scale.sh 8b-pp2" "2,3:GPU_TESTS=0 scale.sh 8b-tp2" "0,1:real_model.sh"
# Each item is GPUS:[VAR=VALUE ...] SCRIPT [ARGS...] (a script of scripts/device/, with its own environment
# settings; no quoting); items naming the same GPUs (the same text) run one after the
# other in the order given, the others at the same time. Each item's output: $OUT/<n>-<script>.log, its tail here.
# The carried wheels are installed once first (setup.sh). Exit status: 1 if any item failed.
set -u
. "$(dirname "$0")/setup.sh"
declare -A queue
order=()
n=0
for item in "$@"; do
  gpus=${item%%:*}; cmd=${item#*:}
  [ -n "${queue[$gpus]+x}" ] || order+=("$gpus")
  queue[$gpus]="${queue[$gpus]:-}${queue[$gpus]:+;}$n:$cmd"
  n=$((n + 1))
done
pids=()
for gpus in "${order[@]}"; do
  (
    IFS=';' read -ra items <<<"${queue[$gpus]}"
    rc=0
    for it in "${items[@]}"; do
      i=${it%%:*}; cmd=${it#*:}
      read -ra words <<<"$cmd"; envs=()
      while [[ ${words[0]:-} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
      script=${words[0]}; log="$OUT/$i-${script%.sh}.log"
      echo "=== [$i] GPUs $gpus: $cmd  ($(date -u +%H:%M:%S))"
      CUDA_VISIBLE_DEVICES=$gpus env "${envs[@]}" bash "$(dirname "$0")/$script" "${words[@]:1}" > "$log" 2>&1
      r=$?; [ $r = 0 ] || rc=1
      echo "=== [$i] done rc=$r ($(date -u +%H:%M:%S)); tail of $log:"; tail -"${TAIL:-12}" "$log"
    done
    exit $rc
  ) &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
