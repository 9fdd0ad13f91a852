# Sourced by the device scripts after setup.sh: the FlashAttention-4 bundle (scripts/fa4_bundle.py) unpacked
# into .carry/fa4-site once (when .carry/fa4 came with this call or an earlier one on the same machine) and put on
# PYTHONPATH; its compiled kernels kept across processes (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED).
if [ -f .carry/fa4/manifest.json ]; then
  "$PY" scripts/fa4_bundle.py install || echo "FlashAttention-4 bundle: install failed"
fi
FA4_ENV=$("$PY" scripts/fa4_bundle.py env)
if [ -n "$FA4_ENV" ]; then
  eval "$FA4_ENV"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
  echo "FlashAttention-4 bundle on PYTHONPATH"
else
  echo "no FlashAttention-4 bundle here (carry .carry/fa4, built by scripts/fa4_bundle.py build): fa4 not installed"
fi
