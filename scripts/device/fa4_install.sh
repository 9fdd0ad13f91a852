#!/usr/bin/env bash
# The FlashAttention-4 bundle onto the GPU machine, one call that carries only .carry/fa4 (the bundle and the
# checkout fill one transfer; the next calls, on the same warm machine, carry .whl as usual and find it
# unpacked): unpack into .carry/fa4-site, import it and run one packed forward+backward of the 8B's attention
# shape against torch's SDPA (no lorafusion import: Megatron comes with .whl), which also fills FlashAttention-4's
# on-disk kernel cache for the later calls. With the Megatron wheel carried too (it is all that
# scripts/bench_attention.py needs besides the image; ~61 MiB in all), the attention benchmark follows in the
# same call: $OUT/attention-<gpu>.json, as scripts/device/attention_bench.sh writes it (BENCH=0: not).
#   bash scripts/device/fa4_install.sh        (carry: .carry/fa4 [and .whl/megatron_core-0.16.1-*.whl])
set -uo pipefail
export PYTHONUNBUFFERED=1 PY=${PYTHON:-python3}
. "$(dirname "$0")/fa4_env.sh"
[ -n "$FA4_ENV" ] || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout "${TIMEOUT:-300}" "$PY" - <<'PY'
import math, time
import torch
t0 = time.perf_counter()
from flash_attn.cute import flash_attn_varlen_func
print(f"import {time.perf_counter() - t0:.1f}s", flush=True)
h, g, d, lengths = 32, 8, 128, [1, 700, 3000, 130]
t = sum(lengths)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
q, k, v, dout = (torch.randn(t, n, d, device="cuda", dtype=torch.bfloat16) for n in (h, g, g, h))
leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
t0 = time.perf_counter()
out, _ = flash_attn_varlen_func(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                max_seqlen_k=max(lengths), softmax_scale=1 / math.sqrt(d), causal=True)
out.backward(dout)
torch.cuda.synchronize()
print(f"first forward+backward (compiles) {time.perf_counter() - t0:.1f}s", flush=True)
ref = [x.float().clone().requires_grad_(True) for x in (q, k, v)]
outs, a = [], 0
for n in lengths:
    qs, ks, vs = (x[a:a + n].transpose(0, 1) for x in ref)
    ks, vs = (x.repeat_interleave(h // g, 0) for x in (ks, vs))
    outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    a += n
want = torch.cat(outs)
want.backward(dout.float())
for name, x, y in zip(("out", "dq", "dk", "dv"), [out, *(l.grad for l in leaves)], [want, *(r.grad for r in ref)]):
    err = ((x.float() - y).norm() / y.norm()).item()
    print(f"{name}: relative error {err:.2e}")
    assert err < 2e-2, name
print("FlashAttention-4 bundle: ok")
PY
echo "smoke rc=$?"
if [ "${BENCH:-1}" = 1 ] && ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-mcore \
    .whl/megatron_core-*.whl || exit 1
  tag=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr 'H' 'h')
  PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site-mcore timeout "${TIMEOUT:-300}" "$PY" scripts/bench_attention.py \
    --out "$OUT/attention-${tag:-gpu}.json" ${ARGS:-} 2>&1 | grep -v '^{' | tee "$OUT/attention.log" | cut -c1-400
  echo "bench rc=${PIPESTATUS[0]}"
fi
