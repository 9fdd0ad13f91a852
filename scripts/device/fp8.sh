#!/usr/bin/env bash
# Issue 23 (FP8 frozen base) on one GPU (kind nvidia-h100-x1, carry .whl). One device call per PHASE:
#   PHASE=probe: scripts/check_fp8.py --sections quant (row-quantization launch variants), scripts/fp8_probe.py
#     (host time per LoRA linear call; the 8B model's LoRA-gradient cosine vs the bf16 base with the first 4/2/1/0
#     layers kept in bf16, uniform and Zipf tokens, dY e5m2, fast accumulation; syncs and host ops of one step).
#   PHASE=main:
#     1. scripts/bench_train.py on configs/llama3.1-8b-4adapters.yaml, one process each, one after the other:
#        bf16 and fp8 at token_capacity $CAP, both without recompute (model.recompute=false: like for like), then
#        fp8 at token_capacity auto with the config's recompute_layers: auto (what the freed memory gives);
#        BENCH_SPECS="bf16 fp8 bf16auto" swaps the last for bf16 at its own auto capacity;
#     2. scripts/check_fp8.py: per-layer error and GEMM times on the 8B shapes, the LoRA linear forward+backward
#        (bf16 one op / fp8 split / fp8 one op), every LoRA gradient's cosine (8B, random base), a profiled step;
#     3. the gpu-marked FP8 tests and the one-op FP8 LoRA tests on CUDA.
#   PHASE=quickstart: configs/quickstart.yaml (model.dtype=bfloat16) trained with a bf16 and then an fp8 base,
#     `lorafusion generate` on configs/quickstart/heldout.jsonl (greedy), `export --merged` of the fp8 run.
#   PHASE=bench: step 1 of main alone (e.g. BENCH_SPECS="bf16 fp8": the like-for-like pair).
#   PHASE=probeqs: probe, then the quickstart (seed 1234) with bf16, fp8 (the shipped default) and fp8k1.
#   PHASE=all: main, then the quickstart pair while the tests run (neither is timed).
#   PHASE=final: the benches, then the quickstart pairs (seeds $QS_SEEDS) while the tests run, then check_fp8.py's
#     per-layer errors and LoRA-linear times ($FINAL_SECTIONS; the model section is fp8_probe.py's, PHASE=probe).
#   run:  PHASE=all bash scripts/device/fp8.sh
# Writes under $OUT: run.log, bf16.json, fp8.json, fp8auto.json, fp8_quality.json, gpu_tests.log (main);
# quickstart.json, qs.log (quickstart); quant.json, fp8_probe.json, probe.log (probe).
set -uo pipefail
. "$(dirname "$0")/setup.sh"  # $OUT, $PY, the carried wheels
PHASE=${PHASE:-all}; CAP=${CAP:-12288}; L=/tmp/fp8logs; mkdir -p "$L"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$SECONDS
bench() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
  "$PY" scripts/make_bench_data.py --out data/bench --rows 256 >/dev/null
  NORC="model.recompute=false model.recompute_layers=null"
  # name:capacity:precision:extra overrides; BENCH_SPECS (space-separated names) picks among them
  declare -A SPEC=([bf16]="bf16:$CAP:bf16:$NORC" [fp8]="fp8:$CAP:fp8:$NORC" [fp8auto]="fp8auto:auto:fp8:"
                   [bf16auto]="bf16auto:auto:bf16:")
  for key in ${BENCH_SPECS:-bf16 fp8 fp8auto}; do
    spec=${SPEC[$key]}
    IFS=: read -r name cap prec extra <<< "$spec"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-150}" "$PY" scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml \
      --rows 256 --steps "${STEPS:-6}" --warmup 2 --skip-hf --out "/tmp/bench_$name" \
      scheduler.token_capacity="$cap" model.base_precision="$prec" $extra > "$L/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS-T0))s"; tail -1 "$L/$name.log" > "$OUT/$name.json"
    grep -v "^{" "$L/$name.log" | grep -i "tokens/s\|error\|Traceback\|lorafusion \|capacity" | head -6
  done
}
quality() {
  timeout "${QUALITY_TIMEOUT:-200}" "$PY" scripts/check_fp8.py --out "$OUT/fp8_quality.json" ${QUALITY_ARGS:-} \
    > "$L/quality.log" 2>&1
  echo "quality rc=$? $((SECONDS-T0))s"; grep -v -i "warn" "$L/quality.log" | cut -c1-400 | tail -12
}
gpu_tests() {
  timeout "${TESTS_TIMEOUT:-150}" "$PY" -m pytest -q -p no:cacheprovider -m "${TEST_MARK:-gpu}" \
    tests/ops/test_fp8_linear.py tests/layers/test_fp8_base.py > "$L/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$L/gpu_tests.log"
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_fp8_lora.py >> "$L/gpu_tests.log" 2>&1
  echo "one-op tests rc=$? $((SECONDS-T0))s"; tail -3 "$L/gpu_tests.log"
  grep -v "DEBUG\|^$" "$L/gpu_tests.log" | tail -60 > "$OUT/gpu_tests.log"
}
qs_summary() {  # what the quickstart runs have written so far -> $OUT/quickstart.json
QS_SEEDS="$QS_SEEDS" QS_VARIANTS="$QS_VARIANTS" "$PY" - > "$OUT/quickstart.json" <<'PY'
import json, os, pathlib, statistics
from lorafusion.inference.generate import expected_matches
out = {}
for seed in os.environ["QS_SEEDS"].split():
    variants = os.environ["QS_VARIANTS"].split()
    for p in variants:
        run = pathlib.Path(f"/tmp/qs-{p}-{seed}")
        s, g, m = run / "summary.json", pathlib.Path(f"{run}-heldout.jsonl"), run / "metrics.jsonl"
        rows = [json.loads(x) for x in g.read_text().splitlines()] if g.is_file() else None
        steps = [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else []
        last10 = {}
        for r in steps:
            if r.get("loss") is not None and "job" in r:
                last10.setdefault(r["job"], []).append(r["loss"])
        summ = json.loads(s.read_text()) if s.is_file() else None
        out[f"{p}_seed{seed}"] = {
            "final_loss": {j: v["final_loss"] for j, v in summ["jobs"].items()} if summ else None,
            "mean_loss_last10": {j: statistics.fmean(v[-10:]) for j, v in last10.items()},
            "heldout_right": expected_matches(rows) if rows else None, "heldout": rows}
    a = out[f"bf16_seed{seed}"]
    for v in variants[1:]:
        b = out[f"{v}_seed{seed}"]
        if a["heldout"] and b["heldout"]:
            out[f"answers_that_differ_{v}_seed{seed}"] = [[x.get("job"), x.get("prompt", x.get("input")), x.get("output"), y.get("output")]
                                                          for x, y in zip(a["heldout"], b["heldout"])
                                                          if x.get("output") != y.get("output")]
        for key in ("final_loss", "mean_loss_last10"):
            if a[key] and b[key]:
                out[f"{key}_{v}_over_bf16_seed{seed}"] = {j: b[key][j] / a[key][j] for j in a[key]}
print(json.dumps(out, indent=1))
PY
}
quickstart() {  # QS_VARIANTS: bf16, fp8 (the shipped default), fp8kN (FP8 with the first N layers bf16)
QS_SEEDS=${QS_SEEDS:-1234 3}; QS_VARIANTS=${QS_VARIANTS:-bf16 fp8}; local pids=()
for seed in $QS_SEEDS; do for v in $QS_VARIANTS; do
  rm -rf "/tmp/qs-$v-$seed"
  case "$v" in fp8k*) CLI=(scripts/fp8_cli.py "${v#fp8k}"); p=fp8 ;; *) CLI=(-m lorafusion.cli); p=$v ;; esac
  ( timeout "${QS_TIMEOUT:-170}" "$PY" "${CLI[@]}" train configs/quickstart.yaml output_dir="/tmp/qs-$v-$seed" \
      model.dtype=bfloat16 model.base_precision="$p" seed="$seed" logging.progress=false logging.tensorboard=false \
      ${QS_ARGS:-} > "$L/qs-$v-$seed.log" 2>&1; echo "train $v seed $seed rc=$? $((SECONDS-T0))s"
    timeout 120 "$PY" "${CLI[@]}" generate "/tmp/qs-$v-$seed" --prompts configs/quickstart/heldout.jsonl \
      --out "/tmp/qs-$v-$seed-heldout.jsonl" --max-new-tokens 12 >> "$L/qs-$v-$seed.log" 2>&1
    echo "generate $v seed $seed rc=$? $((SECONDS-T0))s" ) &
  pids+=("$!")
done; done
# Only these PIDs: a bare `wait` in the main shell also waits for `exec > >(tee ...)` above (bash >= 5.1), which
# never exits, so PHASE=quickstart/probeqs hung until the call's timeout (2026-11-25).
wait "${pids[@]}"
qs_summary
S1=${QS_SEEDS%% *}
timeout 90 "$PY" -m lorafusion.cli export "/tmp/qs-fp8-$S1" --job successor --merged --out /tmp/qs-fp8-merged \
  >> "$L/qs-fp8-$S1.log" 2>&1; echo "export rc=$?"
echo "quickstart $((SECONDS-T0))s"
cat "$L"/qs-*.log | grep -v "DEBUG" | tail -60 > "$OUT/qs.log"
grep -h -v -i "warn" "$L"/qs-*.log | grep "loss\|expected\|exported\|rror" | head -24
}
probe() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
  timeout 60 "$PY" scripts/check_fp8.py --sections quant --out "$OUT/quant.json" > "$L/quant.log" 2>&1
  echo "quant rc=$? $((SECONDS-T0))s"; grep "^quant_variants" "$L/quant.log" | cut -c1-1500
  timeout "${PROBE_TIMEOUT:-150}" "$PY" scripts/fp8_probe.py --out "$OUT/fp8_probe.json" > "$L/probe.log" 2>&1
  echo "probe rc=$? $((SECONDS-T0))s"; grep -v -i "warn" "$L/probe.log" | cut -c1-700 | tail -14
  cp "$L/probe.log" "$OUT/probe.log"
}
case "$PHASE" in
  probe) probe ;;
  probeqs) probe; QS_SEEDS=${QS_SEEDS:-1234} QS_VARIANTS=${QS_VARIANTS:-bf16 fp8 fp8k1} quickstart ;;
  bench) bench ;;
  main) bench; quality; gpu_tests ;;
  quickstart) quickstart ;;
  final) bench; quickstart > "$L/quickstart.out" 2>&1 & QS=$!; gpu_tests; wait "$QS"; cat "$L/quickstart.out"
         QUALITY_ARGS="--sections ${FINAL_SECTIONS:-layers,lora}" quality ;;
  all) bench; quality; quickstart > "$L/quickstart.out" 2>&1 & QS=$!; gpu_tests; wait "$QS"; cat "$L/quickstart.out" ;;
esac
echo "done $((SECONDS-T0))s"
