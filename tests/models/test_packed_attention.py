"""Packed (thd) causal attention: the per-sample reference against an explicit float64 softmax (CPU), and on a
GPU the FlashAttention-2 varlen path against the float64 reference on odd lengths with grouped-query heads,
output and every gradient."""

import math

import pytest
import torch

from lorafusion.models import attention as att

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _unselected(monkeypatch):
    """varlen_attention as a process that selected nothing runs it (a Trainer built earlier in this process
    may have selected another implementation)."""
    monkeypatch.setattr(att, "_SELECTED", None)


def _explicit(q, k, v, lengths, scale):
    """Row by row softmax(q·kᵀ·scale) over the sample's earlier-or-same tokens, GQA by head groups."""
    h, g = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    start = 0
    for n in lengths:
        for head in range(h):
            kv = head // (h // g)
            s = q[start:start + n, head] @ k[start:start + n, kv].T * scale
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[start:start + n, head] = torch.softmax(s, -1) @ v[start:start + n, kv]
        start += n
    return out


def _inputs(lengths, h, g, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, n, d, generator=gen, dtype=torch.float64) for n in (h, g, g))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    dout = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)] + [cu.to(device)]


def _run(fn, q, k, v, dout, *args):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves, *args)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("lengths,h,g",
                         [([5, 1, 3], 4, 2), ([7, 2], 2, 2), ([1], 4, 1), ([4, 9, 1, 6], 6, 3)])
def test_reference_matches_explicit_softmax_with_gradients(lengths, h, g):
    d = 8
    q, k, v, dout, cu = _inputs(lengths, h, g, d, torch.float64, "cpu")
    scale = 1 / math.sqrt(d)
    got = _run(lambda a, b, c: att.varlen_attention(a, b, c, cu, max(lengths), scale), q, k, v, dout)
    want = _run(lambda a, b, c: _explicit(a, b, c, lengths, scale), q, k, v, dout)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_rows_past_the_last_sample_are_zero():
    q, k, v, _, cu = _inputs([3, 4], 4, 2, 8, torch.float64, "cpu")
    out = att.varlen_attention(q, k, v, cu[:-1], 3, 0.3)  # the last sample left out of cu_seqlens
    assert out.shape == q.shape and torch.equal(out[3:], torch.zeros_like(out[3:]))


ODD = [1, 7, 300, 1023, 129, 2, 64, 513]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,g,d", [(32, 8, 128), (8, 8, 64), (12, 4, 128)])
@pytest.mark.parametrize("path", ["fa2", "fa4"])
def test_gpu_packed_attention_vs_float64(path, h, g, d, dtype):
    if path == "fa4":
        _fa4_or_skip()
    fn = att.fa4_attention if path == "fa4" else att.varlen_attention
    q, k, v, dout, cu = _inputs(ODD, h, g, d, dtype, "cuda", seed=h + d)
    scale = 1 / math.sqrt(d)
    got = _run(lambda a, b, c: fn(a, b, c, cu, max(ODD), scale), q, k, v, dout)
    want = _run(lambda a, b, c: att.varlen_attention_reference(a, b, c, cu.cpu(), scale),
                *(x.double() for x in (q, k, v, dout)))
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert x.dtype == dtype and x.shape == y.shape and torch.isfinite(x).all(), i
        assert _rel(x, y) <= 1e-2, (i, _rel(x, y))


def test_out_of_memory_in_varlen_is_raised_and_does_not_switch_to_the_fallback(monkeypatch):
    """An out-of-memory error inside varlen_attn is the caller's (the runtime reports it); only a kernel
    failure switches the process to the per-sample path, which saves one more q-width tensor per token and
    layer (it used to switch on out of memory too, and the memory calibration grids ran on it from their first
    one)."""
    monkeypatch.setattr(att, "_VARLEN_FAILED", False)
    q, k, v, _, cu = _inputs([3, 5], 4, 2, 8, torch.float32, "cpu")
    args = (q, k, v, cu, cu, 5, 0.3, {})

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        att._varlen_or_fallback(oom, *args)
    assert not att._VARLEN_FAILED and att.attention_path() != "per-sample"

    def broken(*a, **kw):
        raise RuntimeError("no kernel for this head dim")

    with pytest.warns(UserWarning, match="per-sample SDPA path"):
        out = att._varlen_or_fallback(broken, *args)
    assert att._VARLEN_FAILED and att.attention_path() == "per-sample"
    torch.testing.assert_close(out, att.varlen_attention_reference(q, k, v, cu, 0.3))


def _fa4_or_skip():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-4 trains on sm_90 or newer")
    try:
        att._fa4_fn()
    except Exception as e:
        pytest.skip(f"flash-attn-4 does not import here: {e}")


@gpu
@pytest.mark.gpu
def test_gpu_auto_selects_an_installed_fa4_and_runs_it(monkeypatch):
    _fa4_or_skip()
    monkeypatch.setattr(att, "_SELECTED", None)
    assert att.select_attention("auto", 32, 8, 128, torch.bfloat16) == "fa4" == att.attention_path()
    q, k, v, dout, cu = _inputs(ODD, 32, 8, 128, torch.bfloat16, "cuda")
    got = _run(lambda a, b, c: att.varlen_attention(a, b, c, cu, max(ODD), 0.1), q, k, v, dout)
    want = _run(lambda a, b, c: att.fa4_attention(a, b, c, cu, max(ODD), 0.1), q, k, v, dout)
    for x, y in zip(got, want, strict=True):  # (dq accumulates atomically: not bitwise repeatable)
        assert _rel(x, y) <= 1e-3
