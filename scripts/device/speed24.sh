#!/usr/bin/env bash
# Issue 24 in one device call: the GPU tests of the new ops, each lever alone (scripts/bench_speed24.py), then
# end-to-end runs of the 8B config side by side (scripts/bench_train.py), logs and JSON under $OUT.
#   run (device tool, carry .whl + this tree):  bash scripts/device/speed24.sh "NAME|ENV|ARGS" ...
# Each run spec: NAME, then space-separated VAR=VALUE settings for that run alone (LORAFUSION_MAIN_GEMM, ...),
# then bench_train arguments; every run gets --skip-hf and $CAP_ARGS. Needs liger-kernel among the wheels.
#   bash scripts/device/speed24.sh "base|LORAFUSION_MAIN_GEMM=cublas|--ablate" "fold|LORAFUSION_MAIN_GEMM=cublas_fold|"
# MICRO=0 / GPU_TESTS=0 skip those parts (MICRO_TUNED=0: the levers once, not again on the tuned configs); CAP_ARGS (default scheduler.token_capacity=12288: the shipped 16384
# does not fit an 80 GB H100; CAP_ARGS= runs the shipped config's auto capacity).
# MODEL_STEP=1: scripts/bench_model_step.py (after TUNE: shipped vs tuned configs, alternating; MODEL_STEP_ARGS
# adds more, e.g. "--setting fold:LORAFUSION_MAIN_GEMM=cublas_fold --profile-setting tuned").
# TUNE="M,K,N ..." first tunes the LoRA kernels at those linears (scripts/tune_kernels.py, TUNE_SEGMENTS equal r=16
# segments, default 4) into /tmp/speed24/tuned.json: a run spec turns them on with
# LORAFUSION_TUNING_FILE=/tmp/speed24/tuned.json. BUDGET (seconds, default 540): a run starts only while at least
# 60 s of it are left, and is cut at the budget.
set -uo pipefail
. scripts/device/setup.sh  # $OUT, $PY, the carried wheels on the GPU machine
L=/tmp/speed24; mkdir -p "$L"  # every log here; $OUT gets one archive of it, refreshed after each step
pack() { tar czf "$OUT/speed24.tgz" -C "$L" . 2>/dev/null; }
t0=$(date +%s)
stamp() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi 2>/dev/null --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader | tee "$L/device.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' | tee -a "$L/device.txt"
# what the image offers for packed attention besides torch's FA2 varlen (FA3/FA4 need their own packages)
"$PY" - <<'EOF' 2>&1 | tee -a "$L/device.txt"
import importlib.util as u, torch.nn.attention as a, pkgutil
print("torch.nn.attention:", sorted(m.name for m in pkgutil.iter_modules(a.__path__)))
def has(m):
    try:
        return u.find_spec(m) is not None
    except ImportError:
        return False
print("importable:", {m: has(m) for m in ("flash_attn", "flash_attn_interface", "flash_attn.cute", "cutlass", "cudnn",
                                          "transformer_engine")})
EOF
if [ "${GPU_TESTS:-1}" = 1 ]; then
  stamp "gpu tests"
  # shellcheck disable=SC2086
  timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_PATHS:-tests/models/test_packed_attention.py \
    tests/kernels/test_kernel_gpu.py} 2>&1 | tail -25 | tee "$L/gpu_tests.log"; pack
fi
if [ -n "${TUNE:-}" ]; then
  stamp "tune the LoRA kernels at: $TUNE"
  # shellcheck disable=SC2086
  timeout -k 10 ${TUNE_TIMEOUT:-150} "$PY" scripts/tune_kernels.py --shapes $TUNE --segments ${TUNE_SEGMENTS:-4} \
    --kernels ${TUNE_KERNELS:-lowrank,shrink,ds_db,da_dx} --out "$L/tuned.json" > "$L/tune.log" 2>&1
  echo "rc=$?"; grep -v '^      ' "$L/tune.log" | tail -20; pack
fi
if [ "${MICRO:-1}" = 1 ]; then  # MICRO_ARGS: bench_speed24 arguments; with TUNE, once more on the tuned configs
  stamp "levers alone"
  # shellcheck disable=SC2086
  timeout ${MICRO_TIMEOUT:-300} "$PY" scripts/bench_speed24.py --out "$L/micro.json" ${MICRO_ARGS:-} 2>&1 | grep -v '^{' | tee "$L/micro.log"; pack
  if [ -s "$L/tuned.json" ] && [ "${MICRO_TUNED:-1}" = 1 ]; then
    stamp "levers alone, tuned configs"
    # shellcheck disable=SC2086
    LORAFUSION_TUNING_FILE="$L/tuned.json" timeout ${MICRO_TIMEOUT:-300} "$PY" scripts/bench_speed24.py \
      --out "$L/micro_tuned.json" ${MICRO_ARGS:-} 2>&1 | grep -v '^{' | tee "$L/micro_tuned.log"; pack
  fi
fi
if [ "${MODEL_STEP:-0}" = 1 ]; then  # the whole model's forward+backward: 4 adapters vs 1, tuned configs vs shipped
  stamp "model step"
  tf=(); [ -s "$L/tuned.json" ] && tf=(--setting "tuned:LORAFUSION_TUNING_FILE=$L/tuned.json")
  # shellcheck disable=SC2086
  timeout -k 10 ${MODEL_STEP_TIMEOUT:-150} "$PY" scripts/bench_model_step.py --profile --out "$L/model_step.json" \
    --budget $(( ${MODEL_STEP_TIMEOUT:-150} - 25 )) "${tf[@]}" ${MODEL_STEP_ARGS:-} > "$L/model_step.log" 2>&1
  echo "rc=$?"; grep -v '^{' "$L/model_step.log" | grep -iv "warn\|USDT" | tail -${MODEL_STEP_TAIL:-90} | cut -c1-300; pack
fi
"$PY" -c 'import liger_kernel' 2>/dev/null || echo "WARNING: liger_kernel does not import: the fused SwiGLU fails and every end-to-end run with it (carry liger_kernel-0.8.5-py3-none-any.whl in .whl)"
"$PY" scripts/make_bench_data.py --out data/bench --rows ${ROWS:-256} >/dev/null
CAP_ARGS=${CAP_ARGS-scheduler.token_capacity=12288}
BUDGET=${BUDGET:-540}
for spec in "$@"; do
  IFS='|' read -r name envs args <<< "$spec"
  left=$(( BUDGET - ($(date +%s) - t0) ))
  if [ "$left" -lt 60 ]; then stamp "=== $name: skipped (${left}s of the budget left)"; continue; fi
  lim=${RUN_TIMEOUT:-420}; [ "$left" -lt "$lim" ] && lim=$left
  stamp "=== $name: env [$envs] args [$args] (limit ${lim}s)"
  # shellcheck disable=SC2086
  # a run cut at its limit gets SIGTERM: the trainer stops at the next chunk boundary and bench_train reports what
  # it measured (RunStopped ends its ablation); -k: killed 60 s later if it has not exited (a chunk runs to its end)
  env $envs BENCH_COMMIT="${BENCH_COMMIT:-}" timeout -k 60 $lim "$PY" scripts/bench_train.py \
    --config ${CONFIG:-configs/llama3.1-8b-4adapters.yaml} --rows ${ROWS:-256} --steps ${STEPS:-6} \
    --warmup ${WARMUP:-2} --out /tmp/bench_$name --skip-hf $args $CAP_ARGS > "$L/$name.log" 2>&1
  echo "rc=$?"
  cp /tmp/bench_$name/result.json "$L/$name.result.json" 2>/dev/null  # written after each system (a cut run keeps it)
  grep -v "^{" "$L/$name.log" | grep -iv "warn" | tail -${TAIL:-12}
  grep -i "backend failed" "$L/$name.log" | head -3
  tail -1 "$L/$name.log" > "$L/$name.json"
  "$PY" - "$L/$name.json" "$L/$name.result.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception:
    try:
        r = json.load(open(sys.argv[2]))  # the run was cut: what it had written
    except Exception as e:
        print("no result:", e); sys.exit()
o = r.get("lorafusion", {})
line = {"tokens_per_s": o.get("tokens_per_s"), "kernels": o.get("kernels"), "peak_gib": o.get("peak_mem_gib"),
        "chunk_s": o.get("chunk_s"), "errors": [k for k in r if "error" in k],
        "cap": (o.get("memory_plan") or {}).get("token_capacity", r.get("token_capacity"))}
for k in ("reference", "scheduler_off"):
    if k in r:
        line[k] = r[k]["tokens_per_s"]
if r.get("profile"):
    p = r["profile"]
    line["busy"] = p.get("gpu_busy_frac")
    line["gaps"] = p.get("idle_gaps_ge_1ms")
    line["top"] = [(t["name"][:50], round(t["ms"]), round(t["frac"], 3)) for t in p.get("top_kernels", [])[:14]]
print(json.dumps(line))
EOF
  pack
done
stamp "done"
