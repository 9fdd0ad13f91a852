"""FusedMultiLoRA vs the torch reference on random segment layouts (CPU: Triton interpreter, fp32)."""

import functools
import random

import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed
from lorafusion.ops.fused import multi_lora_delta_fused, multi_lora_linear_fused
from lorafusion.ops.reference import multi_lora_delta_reference

from ._util import make_adapters, random_routing, reference_linear, rel, run_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 dots are IEEE while torch's float32 matmul precision is "highest" (the default), on the GPU too
TOL32 = 1e-5


def _adapters(case):
    rng = random.Random(case)
    n_slots = rng.randint(1, 4)
    ranks = [rng.choice([1, 3, 8, 16, 21, 70]) for _ in range(n_slots)]
    sc = [rng.uniform(0.25, 2.0) for _ in ranks]
    ps = [rng.choice([0.0, 0.1, 0.5]) for _ in ranks]
    seeds = [mix_seed(case, a) for a in range(n_slots)]
    return rng, ranks, sc, ps, seeds


@pytest.mark.parametrize("case", [0, 1, 2, 256, 3, 4])
def test_multi_lora_linear_random_layouts(case):
    # every main-GEMM variant: Triton GEMM with the low-rank term inside, cuBLAS + Triton low-rank passes, or
    # the same with dX folded (cases 3, 4: the low-rank dX term first, cuBLAS adds dY·W into it)
    fused = functools.partial(multi_lora_linear_fused,
                              main_gemm="cublas_fold" if case in (3, 4)
                              else "triton" if case % 2 == 0 else "cublas")
    torch.manual_seed(7)
    rng, ranks, sc, ps, seeds = _adapters(case)
    if case == 256:  # largest and smallest rank: padded rank block 256, epilogue loops over rank chunks
        ranks, sc, ps, seeds = [256, 1], sc[:1] * 2, [0.1, 0.0], seeds[:1] * 2
    m, k, n = rng.randint(20, 70), rng.randint(17, 50), rng.randint(9, 45)
    routing = random_routing(m, len(ranks), rng)
    x = torch.randn(m, k, device=DEV, requires_grad=True)
    W = torch.randn(n, k, device=DEV) / k**0.5
    bias = torch.randn(n, device=DEV, requires_grad=True)
    A, B = make_adapters(k, n, ranks, torch.float32, DEV)
    g = torch.randn(m, n, device=DEV)
    args = (x, W, bias, A, B, sc, ps, seeds, routing, g)
    y, grads = run_linear(fused, *args)
    y_ref, grads_ref = run_linear(reference_linear, *args)
    assert rel(y, y_ref) < TOL32, routing
    for i, (got, want) in enumerate(zip(grads, grads_ref, strict=True)):
        if want is None:  # a slot with no rows in this batch
            assert got is None or got.abs().max() == 0, i
        else:
            assert got is not None and rel(got, want) < TOL32, (i, routing)


@pytest.mark.parametrize("k_offset", [40, 13])  # 13: shard not 8-aligned, per-element mask path
def test_multi_lora_delta_sharded_input_and_tile_spanning_segments(k_offset):
    """Row-parallel style k_offset/k_total, segments shorter than a tile, a repeated slot, uncovered rows."""
    torch.manual_seed(3)
    m, k, n = 53, 33, 20
    ranks, sc, ps = [4, 16, 9], [1.0, 0.5, 2.0], [0.2, 0.0, 0.3]
    seeds = [mix_seed(9, a) for a in range(3)]
    routing = Routing(segments=((2, 0, 5), (0, 5, 3), (1, 9, 20), (2, 29, 17), (0, 50, 3)), num_rows=m,
                      row_ids=torch.randperm(10_000)[:m])
    x = torch.randn(m, k, device=DEV, requires_grad=True)
    A, B = make_adapters(k, n, ranks, torch.float32, DEV)
    g = torch.randn(m, n, device=DEV)

    def run(fn):
        for t in (x, *A, *B):
            t.grad = None
        out = fn(x, A, B, sc, ps, seeds, routing, k_offset=k_offset, k_total=200)
        out.backward(g)
        return out.detach(), [t.grad.clone() for t in (x, *A, *B)]

    out, grads = run(multi_lora_delta_fused)
    out_ref, grads_ref = run(multi_lora_delta_reference)
    assert rel(out, out_ref) < TOL32
    for got, want in zip(grads, grads_ref, strict=True):
        assert rel(got, want) < TOL32


def test_deterministic_and_cublas_variant():
    torch.manual_seed(4)
    rng = random.Random(4)
    m, k, n = 41, 24, 18
    ranks, sc, ps, seeds = [8, 16], [1.0, 0.5], [0.1, 0.3], [5, 6]
    routing = random_routing(m, 2, rng, gaps=False)
    x = torch.randn(m, k, device=DEV, requires_grad=True)
    W = torch.randn(n, k, device=DEV)
    A, B = make_adapters(k, n, ranks, torch.float32, DEV)
    g = torch.randn(m, n, device=DEV)
    args = (x, W, None, A, B, sc, ps, seeds, routing, g)
    triton_gemm = functools.partial(multi_lora_linear_fused, main_gemm="triton")
    y1, g1 = run_linear(triton_gemm, *args)
    y2, g2 = run_linear(triton_gemm, *args)
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    y3, g3 = run_linear(functools.partial(multi_lora_linear_fused, main_gemm="cublas"), *args)
    assert rel(y3, y1) < TOL32
    for a, b in zip(g3, g1, strict=True):
        assert (a is None and b is None) or rel(a, b) < TOL32
