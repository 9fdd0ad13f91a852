"""The fast torch LoRA path's expand (``kernels: reference`` on CUDA): Δ = s_a·S[:, :r_a]·B_aᵀ per segment in
one autograd op, against the plain-torch reference (autograd of per-segment matmuls, scaling and
concatenation) in float64, over odd shapes, gaps (rows of no adapter), a slot owning two segments, ranks under
r_max, and dtypes; every gradient (S and each B)."""

import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.ops.reference import lora_expand_reference, lora_expand_torch

CASES = [  # (m, n, ranks, segments (slot, start, length))
    (1, 1, [1], [(0, 0, 1)]),
    (37, 29, [4, 16, 3], [(1, 0, 5), (0, 7, 11), (2, 18, 1), (1, 25, 9)]),  # gaps at 5..7, 19..25, 34..37
    (64, 130, [16], [(0, 0, 64)]),
    (50, 7, [8, 2], [(1, 3, 40)]),  # slot 0 has no rows: no gradient for its B
]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _run(fn, S, B, scaling, routing, dy):
    out = fn(S, B, scaling, routing)
    out.backward(dy)
    return [out.detach(), S.grad] + [b.grad for b in B]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_expand_matches_reference_every_gradient(case, dtype):
    m, n, ranks, segs = CASES[case]
    g = torch.Generator().manual_seed(case)
    r_max = max(ranks)
    S0 = torch.randn(m, r_max, generator=g)
    B0 = [torch.randn(n, r, generator=g) for r in ranks]  # fp32 master weights, as the layers keep them
    dy0 = torch.randn(m, n, generator=g)
    scaling = [0.5 + i for i in range(len(ranks))]
    routing = Routing(tuple(segs), m)
    S = S0.to(dtype).clone().requires_grad_()
    B = [b.clone().requires_grad_() for b in B0]
    got = _run(lora_expand_torch, S, B, scaling, routing, dy0.to(dtype))
    Sr = S0.to(dtype).double().detach().requires_grad_()
    Br = [b.double().requires_grad_() for b in B0]
    ref = _run(lora_expand_reference, Sr, Br, scaling, routing, dy0.to(dtype).double())
    assert got[0].dtype == dtype and got[1].dtype == dtype and all(
        b.grad is None or b.grad.dtype == torch.float32 for b in B)
    for name, a, b in zip(["out", "dS"] + [f"dB{i}" for i in range(len(B))], got, ref, strict=True):
        if b is None or not b.abs().sum():  # a slot with no rows: no gradient (or zeros), as the reference
            assert a is None or not a.abs().sum(), name
            continue
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err <= TOL[dtype] and not torch.isnan(a).any(), (name, err)
    covered = torch.zeros(m, dtype=torch.bool)
    for _, start, length in segs:
        covered[start:start + length] = True
    assert not got[0][~covered].any()  # rows of no adapter: zero output (the buffer is not left unwritten)
