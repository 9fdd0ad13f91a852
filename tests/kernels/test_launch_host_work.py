"""The launchers' host-side shortcuts change no number: the per-slot reduction by one split, the memoized
launch configs (which follow the environment), and dS/dB from B given transposed."""

import random

import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.kernels import fused_multi_lora as K
from lorafusion.kernels import tuning
from lorafusion.ops.tables import TableCache

from ._util import random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _by_slicing(partial, ranges, ranks, dim):
    """The reduction as it was: a slice and a sum per slot, then the rank cut."""
    out = []
    for a, r in enumerate(ranks):
        if a not in ranges:
            out.append(None)
            continue
        lo, hi = ranges[a]
        part = partial[lo:hi].sum(0)
        out.append(part[:, :r] if dim == 1 else part[:r])
    return out


@pytest.mark.parametrize("case", range(8))
def test_reduce_by_slot_is_the_per_slot_slice_sum_bitwise(case):
    rng = random.Random(case)
    m = rng.randint(5, 120)
    n_slots = rng.randint(1, 4)
    routing = random_routing(m, n_slots, rng)
    ranks = [rng.choice([3, 16]) for _ in range(n_slots)]
    rb = 16
    _, n_chunks, ranges = TableCache().chunk_table(routing, rng.choice([4, 7, 32]), "cpu", by_slot=True)
    for dim, shape in ((1, (n_chunks, 24, rb)), (0, (n_chunks, rb, 24))):
        partial = torch.randn(shape, dtype=torch.float32)
        got = K._reduce_by_slot(partial, ranges, ranks, rb, dim)
        want = _by_slicing(partial, ranges, ranks, dim)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                assert g.shape == w.shape and torch.equal(g, w)
    # ranges that are not back to back (not the chunk tables' layout) are still summed per slot
    partial = torch.randn(9, 5, rb)
    odd = {0: (4, 6), 1: (0, 3)}
    for g, w in zip(K._reduce_by_slot(partial, odd, [16, 3], rb, 1), _by_slicing(partial, odd, [16, 3], 1)):
        assert torch.equal(g, w)


def test_memoized_launch_configs_equal_the_lookup_and_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LORAFUSION_TUNING_FILE", raising=False)
    shapes = [(8192, 4096, 4096), (5000, 16, 4096), (8192, 4096, 16), (300, 48, 14336), (4096, 64, 8192)]
    for kind in ("gemm", "lowrank", "shrink", "ds_db", "da", "da_dx"):
        for shape in shapes:
            for itemsize in (2, 4):
                for rb in (16, 64, 256):
                    args = (kind, *shape, itemsize, rb)
                    assert K._config(*args) == K.launch_config(*args)
    before = K._config("gemm", 8192, 4096, 4096, 2, 16)
    cfg = dict(BM=64, BN=64, BK=32, GROUP_M=4, num_warps=4, num_stages=2)
    path = tmp_path / "tuned.json"
    path.write_text('[{"kernel": "gemm", "bucket": [8192, 4096, 4096], "config": %s}]'
                    % str(cfg).replace("'", '"'))
    monkeypatch.setenv("LORAFUSION_TUNING_FILE", str(path))  # a tuning run's file, set after the first call
    assert K._config("gemm", 8192, 4096, 4096, 2, 16) == cfg != before
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K._config("gemm", 8192, 4096, 4096, 2, 16) == tuning.INTERPRET["gemm"]


def test_ds_db_from_transposed_b_is_bitwise_the_same():
    torch.manual_seed(0)
    m, n, ranks = 37, 40, [8, 16, 3]
    routing = Routing.from_lengths([0, 1, 2, 1], [9, 11, 7, 10])
    tc = TableCache()
    st = tc.slot_tables(ranks, [1.0, 2.0, 0.5], [0.1, 0.0, 0.2], [3, 4, 5], DEV)
    B_cat = torch.randn(n, sum(ranks), device=DEV)
    S = torch.randn(m, max(ranks), device=DEV)
    dy = torch.randn(m, n, device=DEV)
    dS, dB = K.lora_ds_db(dy, B_cat, S, st, routing, cache=tc)
    Bt = B_cat.t().contiguous()
    dS2, dB2 = K.lora_ds_db(dy, None, S, st, routing, cache=tc, Bt=Bt)
    assert torch.equal(dS, dS2)
    for a, b in zip(dB, dB2, strict=True):
        assert torch.equal(a, b)
