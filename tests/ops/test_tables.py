"""Per-microbatch LoRA state: routing snapshots for recomputation, per-layer seeds built once, the kernels'
table cache, and the fast torch path (``kernels: reference`` on CUDA) against the ground-truth reference."""

import random

import numpy as np
import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.data import pack_microbatch
from lorafusion.ops.tables import TableCache
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import add_adapter, get_lora_context, lora_modules
from lorafusion.layers.lora_linear import LoRAContext, capture_routing, restore_routing
from lorafusion.ops.reference import multi_lora_delta_reference, multi_lora_delta_torch

SPEC = LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1)


def _two_microbatches():
    """Routings exactly as the runtime builds them: packed samples with packing-independent row ids."""
    mb1 = pack_microbatch([("a", [1, 2, 3, 4]), ("b", [5, 6, 7])], row_ids=[10, 11])
    mb2 = pack_microbatch([("b", [8, 9]), ("a", [1, 1, 2, 3, 5])], row_ids=[12, 13])
    return mb1, mb2


@pytest.mark.parametrize("as_tensor", [False, True])
def test_recompute_restores_the_routing_of_its_own_microbatch(as_tensor):
    """Activation recomputation snapshots every context's routing at checkpoint time and restores it in
    backward while 1F1B is on another microbatch. Routings carry row-id arrays (numpy from the packer, or
    tensors); comparing them must not evaluate array truth values (the 70B PP=4 crash)."""
    ctx = LoRAContext(specs={"a": SPEC, "b": SPEC})
    mb1, mb2 = _two_microbatches()
    if as_tensor:
        r = mb1.routing
        mb1.routing = Routing(r.segments, r.num_rows, torch.as_tensor(np.asarray(r.row_ids)))
    ctx.set_batch(mb1.routing, mb1.adapters, [3, 4])
    snap = capture_routing()
    ctx.set_batch(mb2.routing, mb2.adapters, [5, 6])
    restore_routing(snap)
    assert ctx.routing is mb1.routing and ctx.batch_adapters == mb1.adapters and ctx.seeds == (3, 4)
    # an equal-looking but distinct routing is a different microbatch: restored too
    twin = Routing(mb1.routing.segments, mb1.routing.num_rows, mb1.routing.row_ids)
    ctx.set_batch(twin, mb1.adapters, [3, 4])
    restore_routing(snap)
    assert ctx.routing is mb1.routing


def test_layer_seeds_are_built_once_per_microbatch_and_match_the_per_layer_rule(megatron_single):
    from lorafusion.models.provider import build_model
    from lorafusion.core.arch import preset

    model = build_model(preset("tiny-llama"), seed=1)
    add_adapter(model, "a", SPEC, seed=0)
    add_adapter(model, "b",
                LoRASpec(r=8, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj")), seed=0)
    ctx = get_lora_context(model)
    mb, _ = _two_microbatches()
    ctx.set_batch(mb.routing, mb.adapters, [101, 202])
    for key, mod in lora_modules(model):
        present = frozenset(mod.lora_A.keys())
        names = ctx.local_plan(present)[1]
        seeds, on_device = ctx.layer_seeds(present, key, "cpu")
        base = {"a": 101, "b": 202}
        assert seeds == [mix_seed(base[n], name_key(key)) for n in names]
        assert on_device is None  # CPU: the kernels are not used, nothing is copied
    first = ctx.layer_seeds(frozenset({"a"}), "1.linear_fc1", "cpu")
    assert ctx.layer_seeds(frozenset({"a"}), "1.linear_fc1", "cpu") is first  # memoised for the microbatch
    ctx.set_batch(mb.routing, mb.adapters, [7, 8])
    assert (ctx.layer_seeds(frozenset({"a"}), "1.linear_fc1", "cpu")[0]
            == [mix_seed(7, name_key("1.linear_fc1"))])


def test_table_cache_shares_tables_per_routing_and_adapter_set():
    cache = TableCache()
    mb1, mb2 = _two_microbatches()
    t1 = cache.gemm_tables(mb1.routing, 16, "cpu")
    assert cache.gemm_tables(mb1.routing, 16, "cpu") is t1
    assert cache.gemm_tables(mb2.routing, 16, "cpu") is not t1
    ids = cache.row_ids(mb1.routing, "cpu")
    assert ids.tolist() == [10 << 20 | t for t in range(4)] + [11 << 20 | t for t in range(3)]
    assert cache.row_ids(mb1.routing, "cpu") is ids
    assert cache.row_ids(Routing.single(5), "cpu").tolist() == list(range(5))
    st1 = cache.slot_tables([4, 8], [2.0, 1.0], [0.1, 0.0], [5, 6], "cpu")
    st2 = cache.slot_tables([4, 8], [2.0, 1.0], [0.1, 0.0], torch.tensor([7, 8]), "cpu")
    assert st1.scale is st2.scale and st1.thr is st2.thr  # static part once per adapter set
    assert st1.seed.tolist() == [5, 6] and st2.seed.tolist() == [7, 8]
    assert st1.roff.tolist() == [0, 4] and st1.r_max == 8 and st1.dropout
    chunks, n, ranges = cache.chunk_table(mb2.routing, 3, "cpu", by_slot=True)
    assert n == chunks.numel() // 3 and set(ranges) == {0, 1}
    del mb1, t1, ids
    import gc

    gc.collect()
    assert len(cache._routing) == 1  # the dropped microbatch's tables went with it


def _case(seed, device, dtype):
    rng = random.Random(seed)
    m, k, n = rng.randint(20, 60), rng.randint(9, 40), rng.randint(5, 30)
    ranks = [rng.choice([1, 4, 8, 16]) for _ in range(rng.randint(1, 3))]
    segs, pos = [], 0
    while pos < m:
        length = min(m - pos, rng.randint(1, 20))
        if rng.random() < 0.2:  # rows of no adapter
            pos += length
            continue
        segs.append((rng.randrange(len(ranks)), pos, length))
        pos += length
    segs = segs or [(0, 0, m)]
    routing = Routing(tuple(segs), m, row_ids=np.asarray(rng.sample(range(10**6), m), dtype=np.int64))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype).requires_grad_()
    A = [(torch.randn(r, k, generator=g) / k**0.5).to(device).requires_grad_() for r in ranks]
    B = [torch.randn(n, r, generator=g).to(device).requires_grad_() for r in ranks]
    sc = [rng.uniform(0.5, 2.0) for _ in ranks]
    ps = [rng.choice([0.0, 0.1, 0.5]) for _ in ranks]
    seeds = [mix_seed(seed, a) for a in range(len(ranks))]
    k_offset = rng.choice([0, 8, 13])
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return x, A, B, sc, ps, seeds, routing, k_offset, k + k_offset + rng.choice([0, 5]), dy


def _fwd_bwd(fn, x, A, B, sc, ps, seeds, routing, k_offset, k_total, dy):
    for t in (x, *A, *B):
        t.grad = None
    y = fn(x, A, B, sc, ps, seeds, routing, k_offset=k_offset, k_total=k_total)
    y.backward(dy)
    return [y.detach().double()] + [torch.zeros_like(t).double() if t.grad is None else t.grad.double()
                                     for t in (x, *A, *B)]


@pytest.mark.parametrize("seed", range(6))
def test_fast_torch_path_equals_reference(seed):
    """Same function, same masks, every gradient (fp32 on CPU: the graph split changes only the order of
    a few sums, and the expand folds the scaling into B — s·(S·Bᵀ) and S·(s·B)ᵀ round apart by an ulp or
    two)."""
    case = _case(seed, "cpu", torch.float32)
    ref = _fwd_bwd(multi_lora_delta_reference, *case)
    fast = _fwd_bwd(multi_lora_delta_torch, *case)
    for a, b in zip(fast, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item() + 1e-7), (a - b).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(4))
def test_fast_torch_path_on_gpu_bf16_against_fp64(seed):
    """The compiled mask kernel draws the kernels' mask: bf16 on the GPU vs the fp64 reference on CPU."""
    case = _case(seed, "cuda", torch.bfloat16)
    fast = _fwd_bwd(multi_lora_delta_torch, *case)
    x, A, B, *rest = case
    cpu = [x.detach().cpu().double().requires_grad_(),
           [a.detach().cpu().double().requires_grad_() for a in A],
           [b.detach().cpu().double().requires_grad_() for b in B]]
    sc, ps, seeds, routing, k_offset, k_total, dy = rest
    ref = _fwd_bwd(multi_lora_delta_reference, cpu[0], cpu[1], cpu[2], sc, ps, seeds, routing, k_offset,
                   k_total, dy.cpu().double())
    for a, b in zip(fast, ref, strict=True):
        a = a.cpu()
        err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert err <= 2e-2 and not torch.isnan(a).any(), err
