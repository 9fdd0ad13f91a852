"""All adapters' block B's of a fused linear in one pass (layers.fused_proj.ops_b): the same tensors and
gradients as one block_b per adapter, and the fused ops take their concatenation as it is."""

import pytest
import torch

from lorafusion.layers.fused_proj import BlockIndex, block_b, fused_projection_index, ops_b
from lorafusion.ops.fused import _B_cat, _cat_Bt, _joined

IDX = fused_projection_index("linear_qkv", 4 * (2 + 2) * 3, 4, 2, 3)
CHOSEN = ((0, 1, 2), (0, 2), (1,), (0, 1, 2))


def _bs(chosen, ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(torch.isin(IDX, torch.tensor(c)).sum()), r, generator=g).requires_grad_()
            for c, r in zip(chosen, ranks, strict=True)]


def _one_by_one(bs, chosen):
    return [b if c is None else block_b(b, BlockIndex(IDX, c, "cpu")) for b, c in zip(bs, chosen)]


@pytest.mark.parametrize("used", [(0, 1, 2, 3), (0, 2)])  # (0, 2): adapters without rows get no gradient
def test_joint_block_b_equals_one_by_one_bitwise(used):
    bs = _bs(CHOSEN, [5] * 4)
    cache: dict = {}
    new = ops_b(bs, CHOSEN, cache, lambda: IDX)
    old = _one_by_one(bs, CHOSEN)
    assert _joined(new) is not None and _joined(old) is None
    for o, n in zip(old, new, strict=True):
        assert torch.equal(o, n)
    assert torch.equal(_cat_Bt(new, torch.bfloat16), torch.cat(old, 1).t().contiguous().to(torch.bfloat16))
    assert _B_cat(new) is _joined(new) and torch.equal(_B_cat(new), torch.cat(old, 1))
    gs = [torch.randn_like(o) for o in old]
    want = torch.autograd.grad([old[i] for i in used], bs, [gs[i] for i in used], allow_unused=True)
    got = torch.autograd.grad([new[i] for i in used], bs, [gs[i] for i in used], allow_unused=True)
    for w, g in zip(want, got, strict=True):
        assert (w is None) == (g is None) and (w is None or torch.equal(w, g))
    assert ops_b(bs, CHOSEN, cache, lambda: IDX)[0] is not new[0]  # built per call (a graph per forward)


def test_mixed_ranks_or_plain_bs_take_one_by_one_and_the_cache_follows_the_projections():
    bs = _bs(CHOSEN, [5, 5, 3, 5])
    got = ops_b(bs, CHOSEN, {}, lambda: IDX)
    for o, n in zip(_one_by_one(bs, CHOSEN), got, strict=True):
        assert torch.equal(o, n)
    plain = (None, (0, 2))
    bs2 = [torch.randn(48, 5), _bs(((0, 2),), [5])[0]]
    got = ops_b(bs2, plain, {}, lambda: IDX)
    assert got[0] is bs2[0] and torch.equal(got[1], _one_by_one(bs2, plain)[1])
    cache: dict = {}
    first = ops_b(_bs(CHOSEN, [5] * 4), CHOSEN, cache, lambda: IDX)
    other = ((0, 1, 2), (1, 2), (1,), (0, 1, 2))  # an adapter re-added on other projections
    bs3 = _bs(other, [5] * 4, seed=1)
    for o, n in zip(_one_by_one(bs3, other), ops_b(bs3, other, cache, lambda: IDX), strict=True):
        assert torch.equal(o, n)
    assert len(first) == 4
