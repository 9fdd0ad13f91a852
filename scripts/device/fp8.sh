#!/usr/bin/env bash
# The FP8 frozen base on one GPU (carry .whl), one device call per PHASE:
#   PHASE=bench: scripts/bench_train.py on configs/llama3.1-8b-4adapters.yaml, one process each, one after the
#     other: bf16 and fp8 at token_capacity $CAP, both without recompute (like for like), then fp8 at token_capacity
#     auto with the config's recompute_layers: auto (what the freed memory gives); BENCH_SPECS="bf16 fp8 bf16auto"
#     swaps the last for bf16 at its own auto capacity;
#   PHASE=quality: scripts/check_fp8.py (per-layer error and GEMM times on the 8B shapes, the LoRA linear
#     forward+backward, every LoRA gradient's cosine against the bf16 base, a profiled step; QUALITY_ARGS);
#   PHASE=quickstart: configs/quickstart.yaml (model.dtype=bfloat16) trained with a bf16 and an fp8 base per seed
#     in QS_SEEDS, `lorafusion generate` on configs/quickstart/heldout.jsonl (greedy), `export --merged` of fp8;
#   PHASE=main: bench, quality, then the FP8 GPU tests; PHASE=all (default): main with the quickstart pair run
#     while the tests run (neither is timed).
#   run:  PHASE=all bash scripts/device/fp8.sh
# Writes under $OUT: run.log, bf16.json, fp8.json, fp8auto.json (bench); fp8_quality.json (quality);
# gpu_tests.log; quickstart.json, qs.log (quickstart).
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
quickstart() {  # QS_VARIANTS: bf16, fp8 (the shipped default)
QS_SEEDS=${QS_SEEDS:-1234 3}; QS_VARIANTS=${QS_VARIANTS:-bf16 fp8}; local pids=()
for seed in $QS_SEEDS; do for v in $QS_VARIANTS; do
  rm -rf "/tmp/qs-$v-$seed"
  CLI=(-m lorafusion.cli); p=$v
  ( timeout "${QS_TIMEOUT:-170}" "$PY" "${CLI[@]}" train configs/quickstart.yaml output_dir="/tmp/qs-$v-$seed" \
      model.dtype=bfloat16 model.base_precision="$p" seed="$seed" logging.progress=false logging.tensorboard=false \
      ${QS_ARGS:-} > "$L/qs-$v-$seed.log" 2>&1; echo "train $v seed $seed rc=$? $((SECONDS-T0))s"
    timeout 120 "$PY" "${CLI[@]}" generate "/tmp/qs-$v-$seed" --prompts configs/quickstart/heldout.jsonl \
      --out "/tmp/qs-$v-$seed-heldout.jsonl" --max-new-tokens 12 >> "$L/qs-$v-$seed.log" 2>&1
    echo "generate $v seed $seed rc=$? $((SECONDS-T0))s" ) &
  pids+=("$!")
done; done
# Only these PIDs: a bare `wait` in the main shell also waits for `exec > >(tee ...)` above (bash >= 5.1), which
# never exits, so PHASE=quickstart would hang until the call's timeout.
wait "${pids[@]}"
qs_summary
S1=${QS_SEEDS%% *}
timeout 90 "$PY" -m lorafusion.cli export "/tmp/qs-fp8-$S1" --job successor --merged --out /tmp/qs-fp8-merged \
  >> "$L/qs-fp8-$S1.log" 2>&1; echo "export rc=$?"
echo "quickstart $((SECONDS-T0))s"
cat "$L"/qs-*.log | grep -v "DEBUG" | tail -60 > "$OUT/qs.log"
grep -h -v -i "warn" "$L"/qs-*.log | grep "loss\|expected\|exported\|rror" | head -24
}
case "$PHASE" in
  bench) bench ;;
  quality) quality ;;
  main) bench; quality; gpu_tests ;;
  quickstart) quickstart ;;
  all) bench; quality; quickstart > "$L/quickstart.out" 2>&1 & QS=$!; gpu_tests; wait "$QS"; cat "$L/quickstart.out" ;;
esac
echo "done $((SECONDS-T0))s"
