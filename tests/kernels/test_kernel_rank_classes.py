"""Mixed ranks: the row-chunk kernels run each adapter's rows at its own rank block (one launch per block),
not at the batch's largest; the numbers stay those of the reference (CPU: Triton interpreter)."""

import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed
from lorafusion.kernels import fused_multi_lora as K
from lorafusion.ops.fused import multi_lora_linear_fused
from lorafusion.ops.tables import TableCache, rank_block, rank_classes

from ._util import make_adapters, reference_linear, rel, run_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# position of the chunk table among each launcher's positional arguments
CHUNKS_AT = {"_SHRINK": 4, "_DS_DB": 5, "_DA": 4, "_DA_DX": 6}


def _record(monkeypatch):
    """Every row-chunk launch as (kernel, RB, [(slot, rows)] of its chunks)."""
    seen = []
    for name, pos in CHUNKS_AT.items():
        launcher = getattr(K, name)
        orig = launcher.launch

        def launch(grid, *args, _orig=orig, _name=name, _pos=pos, **kw):
            chunks = args[_pos].view(-1, 3).tolist()
            assert grid[-1] == len(chunks)
            seen.append((_name, kw["RB"], [(slot, length) for slot, _, length in chunks]))
            return _orig(grid, *args, **kw)

        monkeypatch.setattr(launcher, "launch", launch)
    return seen


def _same(a, b) -> bool:
    """Bit for bit under the interpreter; on a GPU the two variants are separate compilations (fp32 IEEE
    dots: equal to rounding)."""
    return torch.equal(a, b) if DEV == "cpu" else rel(a, b) < 1e-6


@pytest.fixture(autouse=True)
def _fresh_configs():
    """The launchers memoize configs: none set by a test here outlives it."""
    yield
    K._CONFIGS.clear()


def _with(monkeypatch, kernel, **keys):
    """``kernel``'s launch configs with ``keys`` set (on the GPU and under the interpreter alike)."""
    real = K.__dict__.get("_real_launch_config", K.launch_config)
    monkeypatch.setattr(K, "_real_launch_config", real, raising=False)
    monkeypatch.setattr(K, "launch_config", lambda kind, *a: dict(real(kind, *a), **(keys if kind == kernel
                                                                                        else {})))
    K._CONFIGS.clear()


def test_rank_classes_group_slots_by_their_own_block():
    assert rank_classes([48, 48, 48, 192], {0, 1, 2, 3}) == [(64, 48, (0, 1, 2)), (256, 192, (3,))]
    assert rank_classes([16, 64, 3], {0, 2}) == [(16, 16, (0, 2))]  # slot 1 has no rows: no launch at 64
    assert rank_classes([16, 64], set()) == [(64, 64, ())]


@pytest.mark.parametrize("ranks", [[16, 16, 16, 64], [12, 48, 5], [48, 48, 48, 192], [16, 130]])
def test_work_follows_each_adapters_rank(monkeypatch, ranks):
    """Σ over launched chunks of rows × rank block = Σ over rows of the block of that row's adapter (one
    block for all, the largest, was 4x the work of an r=16 adapter beside an r=64 one). dS and dB: one pass
    at the largest block while it is under 128 (measured faster there), else dS by the shrink kernel (the
    same chunks once more) and dB per block."""
    seen = _record(monkeypatch)
    torch.manual_seed(0)
    m, k, n = 70, 24, 40
    lengths = [20, 17, 19, 9][: len(ranks)]
    routing = Routing(segments=tuple((a, sum(lengths[:a]) + 2, lengths[a]) for a in range(len(ranks))),
                      num_rows=m)  # rows 0-1 and the tail belong to no adapter
    x = torch.randn(m, k, device=DEV, requires_grad=True)
    W = torch.randn(n, k, device=DEV) / k**0.5
    A, B = make_adapters(k, n, ranks, torch.float32, DEV)
    args = (x, W, None, A, B, [1.5] * len(ranks), [0.1] * len(ranks),
            [mix_seed(5, a) for a in range(len(ranks))], routing, torch.randn(m, n, device=DEV))
    run_linear(multi_lora_linear_fused, *args)
    own = sum(length * rank_block(ranks[a]) for a, length in enumerate(lengths))
    top = rank_block(max(ranks))
    split = top >= 128
    want = {"_DA_DX": own, "_SHRINK": own * (2 if split else 1),
            "_DS_DB": own if split else sum(lengths) * top}
    assert {name for name, _, _ in seen} == set(want)
    for name, work_wanted in want.items():
        launches = [(rb, chunks) for kern, rb, chunks in seen if kern == name]
        work = sum(rb * length for rb, chunks in launches for slot, length in chunks if slot >= 0)
        assert work == work_wanted, (name, work, work_wanted)
        blocks = {rb for rb, _ in launches}
        assert blocks == ({top} if name == "_DS_DB" and not split else {rank_block(r) for r in ranks})
        # rows of no adapter are written (zeros) by one launch, the smallest block's
        idle = [rb for rb, chunks in launches for slot, _ in chunks if slot < 0]
        assert set(idle) <= {min(blocks)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("main_gemm", ["cublas", "cublas_fold", "triton"])
def test_mixed_ranks_match_the_reference(dtype, main_gemm):
    torch.manual_seed(1)
    m, k, n = 61, 40, 36
    ranks = [16, 64, 16, 5]
    routing = Routing(segments=((1, 0, 13), (0, 13, 20), (3, 33, 4), (1, 37, 9), (2, 48, 10)), num_rows=m)
    x = torch.randn(m, k, device=DEV, dtype=dtype, requires_grad=True)
    W = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    A, B = make_adapters(k, n, ranks, dtype, DEV, scale_b=0.5)
    g = torch.randn(m, n, device=DEV, dtype=dtype)
    sc, ps, seeds = [2.0, 0.5, 1.0, 1.5], [0.1, 0.0, 0.2, 0.1], [mix_seed(3, a) for a in range(4)]

    def fused(*a):
        return multi_lora_linear_fused(*a, main_gemm=main_gemm)

    y, grads = run_linear(fused, x, W, None, A, B, sc, ps, seeds, routing, g)
    f32 = [t.detach().float().requires_grad_(t.requires_grad) for t in (x, *A, *B)]
    y_ref, ref = run_linear(reference_linear, f32[0], W.float(), None, f32[1:5], f32[5:], sc, ps, seeds,
                            routing, g.float())
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel(y, y_ref) < tol
    for i, (got, want) in enumerate(zip(grads, ref, strict=True)):
        assert (got is None) == (want is None), i
        if want is not None:
            assert rel(got, want) < tol, i


def test_split_ds_db_equals_the_one_pass(monkeypatch):
    """dS by its own (shrink) pass and dB alone, as chosen for large rank blocks, = the one pass over dY."""
    torch.manual_seed(2)
    m, n, ranks = 45, 56, [16, 9]
    routing = Routing(segments=((0, 3, 20), (1, 23, 19)), num_rows=m)
    st = TableCache().slot_tables(ranks, [2.0, 0.5], [0.1, 0.0], [1, 2], DEV)
    dy = torch.randn(m, n, device=DEV)
    B = torch.randn(n, sum(ranks), device=DEV)
    S = torch.randn(m, 16, device=DEV)
    S[:3] = 0
    S[42:] = 0
    S[23:42, 9:] = 0
    one = K.lora_ds_db(dy, B, S, st, routing, cache=TableCache())
    _with(monkeypatch, "ds_db", SPLIT=1)
    split = K.lora_ds_db(dy, B, S, st, routing, cache=TableCache())
    assert rel(split[0], one[0]) < 1e-6 and split[0][:3].abs().max() == 0 == split[0][23:42, 9:].abs().max()
    for got, want in zip(split[1], one[1], strict=True):
        assert _same(got, want)


@pytest.mark.parametrize("acc", [True, False])
def test_da_dx_prefetching_the_next_row_block_changes_no_bit(monkeypatch, acc):
    """dX and dS loaded one row block ahead (the default) = loaded where they are used."""
    torch.manual_seed(4)
    m, k, ranks = 77, 48, [16, 5]
    routing = Routing(segments=((1, 2, 30), (0, 32, 41)), num_rows=m, row_ids=torch.randperm(500)[:m])
    st = TableCache().slot_tables(ranks, [2.0, 0.5], [0.1, 0.3], [7, 8], DEV)
    ids = TableCache().row_ids(routing, DEV)
    x, dS = torch.randn(m, k, device=DEV), torch.randn(m, 16, device=DEV)
    A = torch.randn(sum(ranks), k, device=DEV)
    dx0 = torch.randn(m, k, device=DEV)
    outs = []
    for prefetch in (1, 0):
        _with(monkeypatch, "da_dx", PREFETCH=prefetch)
        outs.append(K.lora_da_dx(x, dS, A, dx0.clone() if acc else None, st, routing, ids, k_total=k,
                                 cache=TableCache()))
    (dx1, da1), (dx0_, da0) = outs
    assert _same(dx1, dx0_)
    for a, b in zip(da1, da0, strict=True):
        assert _same(a, b)


@pytest.mark.parametrize("ranks, rk", [([16, 16], 16), ([16, 100], 64), ([48], 64), ([32, 5], 32)])
def test_low_rank_term_config_is_looked_up_by_its_rank_chunk(monkeypatch, ranks, rk):
    """A low-rank config tuned with rank-16 dots is not used for rank-64 dots (its registers differ: the
    tuned r=16 gate/up config made the r=64 batch 33% slower on an H200)."""
    asked = []
    real = K._config
    monkeypatch.setattr(K, "_config", lambda *a: (asked.append(a), real(*a))[1])
    m, n = 40, 24
    routing = Routing.from_lengths(list(range(len(ranks))), [m // len(ranks)] * len(ranks))
    st = TableCache().slot_tables(ranks, [1.0] * len(ranks), [0.0] * len(ranks), list(range(len(ranks))), DEV)
    S = torch.randn(m, max(ranks), device=DEV)
    Bt = torch.randn(sum(ranks), n, device=DEV)
    K.lora_gemm(None, None, None, S, Bt, st.scale, st, routing, n=n, cache=TableCache())
    assert [a[:4] for a in asked if a[0] == "lowrank"] == [("lowrank", m, n, rk)]
