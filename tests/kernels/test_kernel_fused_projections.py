"""PEFT's LoRA on fused linears (an A and B per targeted projection, lorafusion.layers.fused_proj): the
stacked A and the block B run through the LoRA ops equal the per-projection formula Σ_p s·X·A_pᵀ·B_pᵀ in p's
rows (float64, every gradient), and the fused kernels equal the torch reference on it (fp32, fp16; Triton's
interpreter on CPU)."""

import random

import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed
from lorafusion.layers.fused_proj import BlockIndex, block_b, fused_projection_index, merge_rows, split_rows
from lorafusion.ops.fused import multi_lora_linear_fused
from lorafusion.ops.reference import multi_lora_delta_reference

from ._util import random_routing, rel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (kind, groups, q heads per group, head dim): GQA 2 groups x 3 heads, MHA, odd head dim; gate/up
GEOMS = [("linear_qkv", 2, 3, 4), ("linear_qkv", 3, 1, 5), ("linear_fc1", 1, 1, 0)]
SUBSETS = {"linear_qkv": [(0, 1, 2), (0, 2), (1,), (2,)], "linear_fc1": [(0, 1), (0,), (1,)]}


def _geom(kind, groups, per, hd, ffn=14):
    rows = groups * (per + 2) * hd if kind == "linear_qkv" else 2 * ffn
    return fused_projection_index(kind, rows, groups, per, hd)


def _adapter(index, chosen, r, k, dtype, gen):
    a = torch.randn(len(chosen) * r, k, generator=gen, dtype=torch.float64) / k**0.5
    rows = int(torch.isin(index, torch.tensor(chosen)).sum())
    b = torch.randn(rows, r, generator=gen, dtype=torch.float64)
    return a.to(DEV, dtype).requires_grad_(), b.to(DEV, dtype).requires_grad_()


def _direct(x, a, b, index, chosen, s):
    """Σ_p s·X·A_pᵀ·B_pᵀ into p's rows, one projection at a time."""
    out = x.new_zeros(x.shape[0], index.numel())
    for p, a_p, b_p in zip(chosen, a.chunk(len(chosen)), split_rows(b, index, chosen), strict=True):
        cols = torch.nonzero(index == p).flatten().to(x.device)
        out = out.index_add(1, cols, s * (x @ a_p.t()) @ b_p.t())
    return out


def test_projection_index_and_row_split():
    idx = _geom("linear_qkv", 2, 3, 2)
    assert idx.tolist() == ([0] * 6 + [1] * 2 + [2] * 2) * 2
    assert _geom("linear_fc1", 1, 1, 0, ffn=3).tolist() == [0, 0, 0, 1, 1, 1]
    parts = split_rows(torch.arange(16.0)[:, None], idx, (0, 2))
    assert [p.flatten().tolist() for p in parts] == [[0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], [6, 7, 14, 15]]
    assert torch.equal(merge_rows(parts, idx, (0, 2)), torch.arange(16.0)[:, None])
    with pytest.raises(ValueError, match="not 2 groups"):
        fused_projection_index("linear_qkv", 19, 2, 3, 2)


@pytest.mark.parametrize("geom", GEOMS)
def test_block_b_through_the_reference_equals_per_projection_lora_float64(geom):
    index = _geom(*geom)
    gen = torch.Generator().manual_seed(hash(geom) % 1000)
    m, k = 11, 9
    for chosen in SUBSETS[geom[0]]:
        for r in (1, 3):
            x = torch.randn(m, k, generator=gen, dtype=torch.float64).to(DEV).requires_grad_()
            a, b = _adapter(index, chosen, r, k, torch.float64, gen)
            g = torch.randn(m, index.numel(), generator=gen, dtype=torch.float64).to(DEV)
            got = multi_lora_delta_reference(x, [a], [block_b(b, BlockIndex(index, chosen, DEV))], [0.7],
                                             [0.0], [5], Routing.single(m))
            grads = torch.autograd.grad(got, (x, a, b), g)
            want = _direct(x, a, b, index, chosen, 0.7)
            want_grads = torch.autograd.grad(want, (x, a, b), g)
            assert rel(got, want) < 1e-12, chosen
            for gg, ww in zip(grads, want_grads, strict=True):
                assert gg.shape == ww.shape and rel(gg, ww) < 1e-12, chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("geom", GEOMS)
def test_fused_kernels_equal_reference_on_block_b(geom, dtype):
    """Several adapters (mixed ranks and subsets, dropout) in one packed batch: output and every gradient."""
    index = _geom(*geom)
    rng, gen = random.Random(str(geom)), torch.Generator().manual_seed(3)
    m, k, n = 37, 24, index.numel()
    subsets = SUBSETS[geom[0]]
    slots = [(subsets[i % len(subsets)], r) for i, r in enumerate((2, 5, 8))]
    routing = random_routing(m, len(slots), rng)
    x = (torch.randn(m, k, generator=gen) * 0.5).to(DEV, dtype).requires_grad_()
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    ab = [_adapter(index, c, r, k, torch.float32, gen) for c, r in slots]
    g = (torch.randn(m, n, generator=gen) * 0.1).to(DEV, dtype)
    sc, ps, seeds = [0.5, 2.0, 1.0], [0.1, 0.0, 0.3], [mix_seed(7, i) for i in range(3)]
    leaves = [x] + [t for pair in ab for t in pair]
    out = {}
    for impl in ("reference", "fused"):
        bs = [block_b(b, BlockIndex(index, c, DEV)) for (c, _), (_, b) in zip(slots, ab, strict=True)]
        a_list = [a for a, _ in ab]
        if impl == "fused":
            y = multi_lora_linear_fused(x, w, None, a_list, bs, sc, ps, seeds, routing)
        else:  # in fp32 (the ground truth for the fp16 run)
            xr = x.float()
            y = torch.nn.functional.linear(xr, w.float()) + multi_lora_delta_reference(
                xr, a_list, bs, sc, ps, seeds, routing)
        grads = torch.autograd.grad(y, leaves, g.to(y.dtype), allow_unused=True)
        out[impl] = (y.float(), grads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(out["fused"][0], out["reference"][0]) < tol
    for i, (got, want) in enumerate(zip(out["fused"][1], out["reference"][1], strict=True)):
        if want is None or want.abs().max() == 0:
            assert got is None or got.abs().max() == 0, i
        else:
            assert rel(got.float(), want.float()) < tol, i
