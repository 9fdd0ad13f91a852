#!/usr/bin/env bash
# Interleaved 1F1B on the GPUs, in one call on a machine of 2 or more GPUs (carry .whl: setup.sh):
#   bash scripts/device/interleaved_check.sh                # every default check whose GPU count fits
#   bash scripts/device/interleaved_check.sh pp2-v2 pp2-v2-eager   # chosen checks
# Checks (the quickstart model, configs/quickstart.yaml: tiny LLaMA, 4 layers, fp32, three adapter jobs on
# packed microbatches of varying lengths, so every p2p call exchanges shapes first):
#   pp2-v2            2  PP=2 x 2 virtual stages (a ring of two ranks, one layer per model chunk)
#   pp2-v2-recompute  2  the same with full activation recompute
#   pp2-v2-dp2        4  DP=2 x PP=2 x 2 virtual stages
#   pp2-v2-eager      2  pp2-v2 with CUDA_MODULE_LOADING=EAGER (not by default: tells whether a kernel's
#                        first, lazy load inside the schedule is what waits)
#   pp2-v2-bf16       2  pp2-v2 in bfloat16 (FlashAttention instead of the fp32 per-sample attention; not by
#                        default)
# Each trains STEPS (8) optimizer steps per job through `lorafusion train` under torchrun, stopped after
# RUN_TIMEOUT (240) s with every rank's Python stack (scripts/device/watch.sh); then the same config on one GPU.
# Prints per (job, step) the loss and gradient norm of both and "PASS name" when the run ended within the time
# and every loss and gradient norm agrees with the one-GPU run to TOL (1e-3, relative), else "FAIL name",
# every rank's stack and the last lines of every rank's schedule trace. Exit status 0 when every check passed.
# One log per check, $OUT/interleaved_<name>.log: the run's output (NCCL warnings, torch's notices of each host
# synchronisation inside the schedule: LORAFUSION_SYNC_DEBUG=$SYNC_DEBUG, default warn), the stacks of a hang,
# each rank's schedule trace (LORAFUSION_PIPELINE_TRACE: every p2p call, forward, backward and optimizer step
# in order, megatron_patches/trace.py) and the one-GPU run's output.
set -uo pipefail
# NCCL's own warnings, its errors raised in the process that waits (not a silent hang), the stack of every
# thread of a hung rank, and torch's notice of each host synchronisation inside the schedule
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export LORAFUSION_SYNC_DEBUG=${SYNC_DEBUG:-warn}
. "$(dirname "$0")/multi_gpu.sh"  # $OUT, $PY, the carried wheels, NCCL settings, $NGPU, $BENCH_COMMIT
STEPS=${STEPS:-8}; TOL=${TOL:-1e-3}; WORK=${CHECK_TMP:-/tmp}/interleaved_check
STEP_ARGS="jobs.0.max_steps=$STEPS jobs.1.max_steps=$STEPS jobs.2.max_steps=$STEPS"

# name -> "GPUS OVERRIDES..."
spec() {
  case "$1" in
    pp2-v2)           echo "2 parallelism.pp=2 parallelism.virtual_stages=2" ;;
    pp2-v2-recompute) echo "2 parallelism.pp=2 parallelism.virtual_stages=2 model.recompute=true" ;;
    pp2-v2-dp2)       echo "4 parallelism.pp=2 parallelism.virtual_stages=2" ;;
    pp2-v2-eager)     echo "2 env:CUDA_MODULE_LOADING=EAGER parallelism.pp=2 parallelism.virtual_stages=2" ;;
    pp2-v2-bf16)      echo "2 parallelism.pp=2 parallelism.virtual_stages=2 model.dtype=bfloat16" ;;
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

traces() {  # traces PREFIX: the last lines of every rank's schedule trace
  local f
  for f in "$1".rank*; do
    [ -f "$f" ] || continue
    echo "--- schedule trace $(basename "$f") (last ${TRACE_TAIL:-40} of $(wc -l < "$f") events)"
    tail -"${TRACE_TAIL:-40}" "$f"
  done
}

pairing() {  # pairing PREFIX: whether two-rank rings issued their p2p operations in matching order
  "$PY" - "$1" <<'EOF'
# NCCL runs a peer pair's p2p operations in issue order on one stream. In a ring of two ranks (PP=2) the
# activations and the gradients go to the same peer, so the k-th operation of one rank must meet the k-th of
# the other (a send and a receive of the same direction): Megatron's _p2p_ops orders each call's operations
# by rank parity for that. Read from the schedule traces.
import glob, re, sys
ops, peer = {}, {}
for f in sorted(glob.glob(sys.argv[1] + ".rank*")):
    rank = int(f.rsplit("rank", 1)[1])
    seq = []
    for line in open(f):
        m = re.search(r"P2P begin send_next=(\S+) send_prev=(\S+) recv_prev=(\d) recv_next=(\d).*"
                      r"prev=(\d+) next=(\d+)", line)
        if not m:
            continue
        sn, sp, rp, rn, prev, nxt = m.groups()
        peer[rank] = (int(prev), int(nxt))
        call = [("S", "fwd", sn)] * (sn != "-") + [("R", "fwd", None)] * (rp == "1")
        back = [("S", "bwd", sp)] * (sp != "-") + [("R", "bwd", None)] * (rn == "1")
        if rank % 2:  # odd ranks receive first (megatron _p2p_ops)
            call, back = call[::-1], back[::-1]
        seq += call + back
    ops[rank] = seq
for r in sorted(ops):
    p, n = peer.get(r, (None, None))
    if p is None or p != n or r > p:
        continue
    a, b = ops[r], ops.get(p, [])
    bad = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] == y[0] or x[1] != y[1]), None)
    state = "pair one to one" if bad is None else f"DO NOT pair from operation {bad}: {a[bad]} vs {b[bad]}"
    print(f"p2p order, ranks {r} and {p}: {len(a)} and {len(b)} operations issued, {state}")
EOF
}

status=0
mkdir -p "$WORK"
first=${CUDA_VISIBLE_DEVICES:-0}; first=${first%%,*}  # the one-GPU runs: the first GPU this script may use
for name in $RUNS; do
  s=$(spec "$name") || { echo "unknown check $name (known: $ALL pp2-v2-eager pp2-v2-bf16)"; status=2; continue; }
  read -r gpus overrides <<<"$s"
  envs=$(echo "$overrides" | tr ' ' '\n' | sed -n 's/^env://p' | tr '\n' ' ')
  overrides=$(echo "$overrides" | tr ' ' '\n' | grep -v '^env:' | tr '\n' ' ')
  if [ "$gpus" -gt "$NGPU" ]; then echo "=== $name: needs $gpus GPUs, $NGPU here: skipped"; continue; fi
  out=$WORK/$name; ref=$WORK/$name-1gpu; log=$OUT/interleaved_$name.log; trace=$WORK/$name-trace
  rm -rf "$out" "$ref" "$trace".rank*
  # shellcheck disable=SC2086
  cmd="$PY -m torch.distributed.run --standalone --nproc_per_node $gpus -m lorafusion.cli train configs/quickstart.yaml \
output_dir=$out $STEP_ARGS $overrides"
  echo "=== $name: ${envs:+$envs}$cmd" | tee "$log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  env $envs LORAFUSION_PIPELINE_TRACE="$trace" bash scripts/device/watch.sh "${RUN_TIMEOUT:-240}" $cmd >> "$log" 2>&1
  rc=$?; echo "rc=$rc after $(($(date +%s) - start)) s" | tee -a "$log"
  traces "$trace" >> "$log"
  pairing "$trace" | tee -a "$log"
  refover=$(echo "$overrides" | tr ' ' '\n' | grep '^model\.' | tr '\n' ' ')
  echo "=== $name: the same on one GPU (GPU $first)" >> "$log"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$first LORAFUSION_SYNC_DEBUG= "$PY" -m lorafusion.cli train configs/quickstart.yaml \
    output_dir="$ref" $STEP_ARGS $refover >> "$log" 2>&1 || echo "(the one-GPU run failed: see $log)"
  if [ $rc = 0 ] && compare "$out" "$ref" | tee -a "$log"; then
    echo "PASS $name"
  else
    [ $rc = 0 ] || compare "$out" "$ref" | tee -a "$log"
    echo "FAIL $name (rc=$rc)"; status=1
    # the run's last lines before any stack dump, then every rank's stacks (watch.sh) and schedule trace
    sed -n '/=== watch.sh/q;p' "$log" | grep -v "^{" | tail -"${TAIL:-30}"
    sed -n '/=== watch.sh/,/^=== .*one GPU/p' "$log" | grep -v "^{" | head -"${STACK_LINES:-400}"
  fi
  grep -h "called a synchronizing" "$log" | sort | uniq -c | head -20 | sed 's/^/host sync inside the schedule: /'
done
exit $status
