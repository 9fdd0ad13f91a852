# Sourced by the device scripts (scale.sh, online.sh, use.sh): $OUT and $PY, and on the GPU machine the carried
# wheels (.whl/, built for its Python 3.12 image) installed under /tmp/site and the FlashAttention-4 bundle when
# one was unpacked (fa4_env.sh); elsewhere the checkout's own env.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
  # once per set of wheels (scripts run side by side on one machine share /tmp/site: together.sh installs first)
  stamp=$(ls -l .whl/*.whl | md5sum | cut -c1-16)
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    echo "$stamp" > /tmp/site/.wheels
  fi
  export PYTHONPATH=$PWD:/tmp/site
  # FlashAttention-4 on PYTHONPATH when a call brought its bundle (model.attention: auto then takes it, as a user's
  # install of the extra would): every device script runs what the CLI picks on that machine
  . "$(dirname "${BASH_SOURCE[0]}")/fa4_env.sh"
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
