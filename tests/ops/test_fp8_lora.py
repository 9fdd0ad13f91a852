"""FP8 base + LoRA in one op (lorafusion.ops.fp8_lora) against the split torch form (fp8_linear + the LoRA
reference): output and every gradient (x, bias, each A, each B) over odd shapes × dtypes and random segment
layouts (CPU: Triton interpreter, fp32/fp16; torch._scaled_mm or its fallback for the base GEMM); and the
expand kernel's in-place accumulation on its own."""

from __future__ import annotations

import random

import pytest
import torch

from lorafusion.core.seeds import mix_seed
from lorafusion.ops import fp8_linear as F
from lorafusion.ops.fp8_lora import fp8_multi_lora_linear, fp8_multi_lora_linear_reference

from tests.kernels._util import make_adapters, random_routing, rel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (m, k, n): K and N multiples of 16 take torch._scaled_mm, the others its float32 fallback
SHAPES = [(37, 48, 32), (64, 32, 80), (23, 20, 7), (1, 16, 16), (50, 33, 45)]
DTYPES = [torch.float32, torch.float16] if DEV == "cpu" else [torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(m, k, n, dtype, seed):
    rng = random.Random(seed)
    ranks = [rng.choice([1, 4, 8, 16]) for _ in range(rng.randint(1, 3))]
    sc = [rng.uniform(0.25, 2.0) for _ in ranks]
    ps = [rng.choice([0.0, 0.1, 0.5]) for _ in ranks]
    seeds = [mix_seed(seed, a) for a in range(len(ranks))]
    routing = random_routing(m, len(ranks), rng)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * (torch.rand(m, 1, generator=g) + 0.1)).to(DEV, dtype)
    w = torch.randn(n, k, generator=g) * 0.1 * (torch.rand(n, 1, generator=g) + 0.1)
    w_q, w_s = F.quantize_weight(w.to(DEV))
    bias = torch.randn(n, generator=g).to(DEV, dtype)
    A, B = make_adapters(k, n, ranks, dtype, DEV)
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)
    return x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, dy


def _in_float32(args):
    """The case in float32 on the CPU (CUDA's row-wise FP8 GEMMs write only bfloat16; the CPU's take
    float32), the FP8 weight unchanged."""
    x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, dy = args
    up = [t.float().cpu() for t in A], [t.float().cpu() for t in B]
    return (x.float().cpu(), w_q.cpu(), w_s.cpu(), bias.float().cpu(), *up, sc, ps, seeds, routing,
            dy.float().cpu())


def _run(fn, x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, dy):
    leaves = [x.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True),
              *[a.detach().clone().requires_grad_(True) for a in A],
              *[b.detach().clone().requires_grad_(True) for b in B]]
    ns = len(A)
    y = fn(leaves[0], w_q, w_s, leaves[1], leaves[2:2 + ns], leaves[2 + ns:], sc, ps, seeds, routing)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_fused_fp8_lora_linear_equals_the_split_form(m, k, n, dtype):
    torch.manual_seed(m * 7 + k)  # (the adapters come from the global generator)
    args = _case(m, k, n, dtype, seed=m * 7 + k)
    y, grads = _run(fp8_multi_lora_linear, *args)
    # the split form in float32 (the same FP8 base): in half precision its own rounding can exceed the fused
    # op's by 10x (one-row dS·A products), so it is the reference only at the higher precision
    y_ref, grads_ref = _run(fp8_multi_lora_linear_reference, *_in_float32(args))
    assert y.dtype == dtype and y.shape == (m, n)
    tol = TOL[dtype]
    assert rel(y.float().cpu(), y_ref) < tol
    names = ["x", "bias"] + [f"A{i}" for i in range(len(args[4]))] + [f"B{i}" for i in range(len(args[4]))]
    for name, got, want in zip(names, grads, grads_ref, strict=True):
        if want is None or want.abs().max() == 0:  # a slot with no rows in this layout
            assert got is None or got.abs().max() == 0, name
        else:
            assert rel(got.float().cpu(), want) < tol, (name, rel(got.float().cpu(), want))


def test_no_input_gradient_still_gives_the_lora_gradients():
    x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, dy = _case(40, 32, 48, DTYPES[0], seed=5)
    A = [a.detach().requires_grad_(True) for a in A]
    B = [b.detach().requires_grad_(True) for b in B]
    fp8_multi_lora_linear(x, w_q, w_s, None, A, B, sc, ps, seeds, routing).backward(dy)
    A2 = [a.detach().clone().requires_grad_(True) for a in A]
    B2 = [b.detach().clone().requires_grad_(True) for b in B]
    fp8_multi_lora_linear_reference(x, w_q, w_s, None, A2, B2, sc, ps, seeds, routing).backward(dy)
    for a, a2 in zip(A + B, A2 + B2, strict=True):
        if a2.grad is not None and a2.grad.abs().max() > 0:
            assert rel(a.grad, a2.grad) < TOL[DTYPES[0]]


def test_expand_accumulates_into_out_in_place():
    from lorafusion.kernels import fused_multi_lora as K
    from lorafusion.ops.fused import _Plan

    x, _, _, bias, A, B, sc, ps, seeds, routing, _ = _case(29, 24, 40, DTYPES[0], seed=3)
    plan = _Plan(x, A, B, sc, ps, seeds, routing)
    S = torch.randn(29, plan.st.r_max, device=DEV, dtype=x.dtype)
    Bt = torch.cat([b.detach() for b in B], dim=1).t().contiguous()
    fresh = K.lora_gemm(None, None, bias, S, Bt, plan.st.scale, plan.st, routing, n=40, cache=plan.cache)
    base = torch.randn(29, 40, device=DEV, dtype=x.dtype)
    out = base.clone()
    ptr = out.data_ptr()
    res = K.lora_gemm(None, None, bias, S, Bt, plan.st.scale, plan.st, routing, n=40, out=out,
                      accumulate=True, cache=plan.cache)
    assert res.data_ptr() == ptr
    assert rel(res, base + fresh) < TOL[DTYPES[0]]
    with pytest.raises(ValueError, match="accumulate needs out"):
        K.lora_gemm(None, None, None, S, Bt, plan.st.scale, plan.st, routing, n=40, accumulate=True,
                    cache=plan.cache)


def test_forward_and_backward_read_nothing_back_to_the_host():
    """No op of the FP8 one-op linear's forward+backward reads a tensor value on the host (``.item()``,
    ``bool(t)``, ``.tolist()``, nonzero...): on CUDA each of those waits for the GPU. Counted at the
    dispatcher (on CPU the same Python code runs; the seeds already on the device, as the LoRA layers pass
    them)."""
    from dispatch_utils import OpWatch

    from lorafusion.ops.tables import TableCache

    seen: list[str] = []

    x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, dy = _case(48, 32, 64, DTYPES[0], seed=9)
    A = [a.detach().requires_grad_(True) for a in A]
    B = [b.detach().requires_grad_(True) for b in B]
    x = x.detach().requires_grad_(True)
    cache, seed_table = TableCache(), torch.tensor(seeds, dtype=torch.int64, device=DEV)
    # the routing's tables built (once a microbatch)
    fp8_multi_lora_linear(x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, cache=cache,
                          seed_table=seed_table).backward(dy)
    with OpWatch(seen=seen):
        fp8_multi_lora_linear(x, w_q, w_s, bias, A, B, sc, ps, seeds, routing, cache=cache,
                              seed_table=seed_table).backward(dy)
    assert seen == []
    with OpWatch(seen=seen):  # the watch itself sees a host read
        float(x.sum())
    assert seen == ["aten._local_scalar_dense.default"]
