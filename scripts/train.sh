#!/usr/bin/env bash
# Single-node launcher: every GPU of this machine (or NPROC processes) runs one rank of `lorafusion train`.
#   scripts/train.sh configs/llama3.1-8b-4adapters.yaml [key=value ...] [--resume]
# The run YAML's parallelism (tp*pp*dp) must equal the process count (dp: auto fills it in).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m lorafusion.cli train "$@"
