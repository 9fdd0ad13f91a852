#!/usr/bin/env bash
# Interleaved 1F1B on the GPUs, in one call on a machine of 2 or more GPUs (carry .whl: setup.sh):
#   bash scripts/device/interleaved_check.sh                # every check whose GPU count fits the machine
#   bash scripts/device/interleaved_check.sh pp2-v2         # chosen checks
# Checks (the quickstart model, configs/quickstart.yaml: tiny LLaMA, 4 layers, fp32, three adapter jobs on
# packed microbatches of varying lengths, so every p2p call exchanges shapes first):
#   pp2-v2            2  PP=2 x 2 virtual stages (a ring of two ranks, one layer per model chunk)
#   pp2-v2-recompute  2  the same with full activation recompute
#   pp2-v2-dp2        4  DP=2 x PP=2 x 2 virtual stages
# Each trains STEPS (8) optimizer steps per job through `lorafusion train` under torchrun, stopped after
# RUN_TIMEOUT (240) s with every rank's Python stack (scripts/device/watch.sh); then the same config on one GPU.
# Prints per (job, step) the loss and gradient norm of both and "PASS name" when the run ended within the time
# and every loss and gradient norm agrees with the one-GPU run to TOL (1e-3, relative), else "FAIL name" and
# each rank's last lines. Exit status 0 when every check passed. Logs: $OUT/interleaved_<name>.log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
STEPS=${STEPS:-8}; TOL=${TOL:-1e-3}; WORK=${CHECK_TMP:-/tmp}/interleaved_check
STEP_ARGS="jobs.0.max_steps=$STEPS jobs.1.max_steps=$STEPS jobs.2.max_steps=$STEPS"

# name -> "GPUS OVERRIDES..."
spec() {
  case "$1" in
    pp2-v2)           echo "2 parallelism.pp=2 parallelism.virtual_stages=2" ;;
    pp2-v2-recompute) echo "2 parallelism.pp=2 parallelism.virtual_stages=2 model.recompute=true" ;;
    pp2-v2-dp2)       echo "4 parallelism.pp=2 parallelism.virtual_stages=2" ;;
    *) return 1 ;;
  esac
}
ALL="pp2-v2 pp2-v2-recompute pp2-v2-dp2"
RUNS=${*:-}
if [ -z "$RUNS" ]; then
  for r in $ALL; do read -r g _ <<<"$(spec "$r")"; [ "$g" -le "$NGPU" ] && RUNS="$RUNS $r"; done
fi

compare() {  # compare OUT_DIR REF_DIR: the table and PASS/FAIL's verdict (exit status)
  "$PY" - "$1" "$2" "$TOL" <<'EOF'
import json, sys
from pathlib import Path

def rows(d):
    f = Path(d) / "metrics.jsonl"
    if not f.is_file():
        return {}
    out = {}
    for line in f.read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out[(r["job"], r["step"])] = r
    return out

ours, ref, tol = rows(sys.argv[1]), rows(sys.argv[2]), float(sys.argv[3])
bad = 0 if ours and ours.keys() == ref.keys() else 1
print(f"{'job':<12}{'step':>5}{'loss':>14}{'loss 1 GPU':>14}{'grad_norm':>14}{'1 GPU':>14}")
for key in sorted(ours.keys() | ref.keys()):
    a, b = ours.get(key, {}), ref.get(key, {})
    cells = []
    for k in ("loss", "grad_norm"):
        x, y = a.get(k), b.get(k)
        ok = x is not None and y is not None and abs(x - y) <= tol * max(abs(y), 1e-12)
        bad += not ok
        cells += [f"{x:.6g}" if x is not None else "-", (f"{y:.6g}" if y is not None else "-") + ("" if ok else " *")]
    print(f"{key[0]:<12}{key[1]:>5}" + "".join(f"{c:>14}" for c in cells))
print(f"{len(ours)} steps here, {len(ref)} on one GPU, {bad} disagreeing (*)")
sys.exit(1 if bad else 0)
EOF
}

status=0
mkdir -p "$WORK"
first=${CUDA_VISIBLE_DEVICES:-0}; first=${first%%,*}  # the one-GPU runs: the first GPU this script may use
for name in $RUNS; do
  s=$(spec "$name") || { echo "unknown check $name (known: $ALL)"; status=2; continue; }
  read -r gpus overrides <<<"$s"
  if [ "$gpus" -gt "$NGPU" ]; then echo "=== $name: needs $gpus GPUs, $NGPU here: skipped"; continue; fi
  out=$WORK/$name; ref=$WORK/$name-1gpu; log=$OUT/interleaved_$name.log
  rm -rf "$out" "$ref"
  # shellcheck disable=SC2086
  cmd="$PY -m torch.distributed.run --standalone --nproc_per_node $gpus -m lorafusion.cli train configs/quickstart.yaml \
output_dir=$out $STEP_ARGS $overrides"
  echo "=== $name: $cmd"
  start=$(date +%s)
  # shellcheck disable=SC2086
  bash scripts/device/watch.sh "${RUN_TIMEOUT:-240}" $cmd > "$log" 2>&1  # a hang: stacks, then 124
  rc=$?; echo "rc=$rc after $(($(date +%s) - start)) s"
  refover=$(echo "$overrides" | tr ' ' '\n' | grep '^model\.' | tr '\n' ' ')
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$first "$PY" -m lorafusion.cli train configs/quickstart.yaml output_dir="$ref" $STEP_ARGS \
    $refover > "$log.1gpu" 2>&1 || echo "(the one-GPU run failed: $log.1gpu)"
  if [ $rc = 0 ] && compare "$out" "$ref"; then
    echo "PASS $name"
  else
    [ $rc = 0 ] || compare "$out" "$ref"
    echo "FAIL $name (rc=$rc)"; status=1
    grep -v "^{" "$log" | tail -"${TAIL:-40}"
  fi
done
exit $status
