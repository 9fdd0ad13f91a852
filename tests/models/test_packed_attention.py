"""Packed (thd) causal attention: the per-sample reference against an explicit float64 softmax (CPU), the
backend switch, and on a GPU cuDNN's ragged path and FlashAttention-2 against the float64 reference on odd
lengths with grouped-query heads, output and every gradient."""

import math

import pytest
import torch

from lorafusion.models import attention as att
from lorafusion.models.cudnn_attention import cudnn_varlen_attention, cudnn_varlen_available

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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


@pytest.mark.parametrize("lengths,h,g", [([5, 1, 3], 4, 2), ([7, 2], 2, 2), ([1], 4, 1), ([4, 9, 1, 6], 6, 3)])
def test_reference_matches_explicit_softmax_with_gradients(lengths, h, g):
    d = 8
    q, k, v, dout, cu = _inputs(lengths, h, g, d, torch.float64, "cpu")
    scale = 1 / math.sqrt(d)
    got = _run(lambda a, b, c: att.varlen_attention(a, b, c, cu, max(lengths), scale), q, k, v, dout)
    want = _run(lambda a, b, c: _explicit(a, b, c, lengths, scale), q, k, v, dout)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_backend_switch(monkeypatch):
    monkeypatch.delenv("LORAFUSION_ATTENTION", raising=False)
    assert att.attention_backend() == att.AUTO_BACKEND
    for name in ("flash", "cudnn", " CUDNN "):
        monkeypatch.setenv("LORAFUSION_ATTENTION", name)
        assert att.attention_backend() == name.strip().lower()
    monkeypatch.setenv("LORAFUSION_ATTENTION", "flex")
    with pytest.raises(ValueError, match="LORAFUSION_ATTENTION: expected one of"):
        att.attention_backend()


def test_cpu_and_fp32_take_the_reference(monkeypatch):
    monkeypatch.setenv("LORAFUSION_ATTENTION", "cudnn")
    q, k, v, _, cu = _inputs([3, 4], 4, 2, 8, torch.float32, "cpu")
    assert not cudnn_varlen_available(q)
    torch.testing.assert_close(att.varlen_attention(q, k, v, cu, 4, 0.3),
                               att.varlen_attention_reference(q, k, v, cu, 0.3))


def test_cudnn_op_refuses_bad_head_groups():
    q, k, v, _, cu = _inputs([3], 4, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="G dividing H"):
        cudnn_varlen_attention(q, k, v, cu, 3, 0.3)


ODD = [1, 7, 300, 1023, 129, 2, 64, 513]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,g,d", [(32, 8, 128), (8, 8, 64), (12, 4, 128)])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_gpu_backends_vs_float64(backend, h, g, d, dtype, monkeypatch):
    monkeypatch.setenv("LORAFUSION_ATTENTION", backend)
    monkeypatch.setattr(att, "_FAILED", set())
    q, k, v, dout, cu = _inputs(ODD, h, g, d, dtype, "cuda", seed=h + d)
    scale = 1 / math.sqrt(d)
    if backend == "cudnn":  # the op itself (no silent fallback), with a loose upper bound on the lengths
        assert cudnn_varlen_available(q)
        fn = lambda a, b, c: cudnn_varlen_attention(a, b, c, cu, 2048, scale)  # noqa: E731
    else:
        fn = lambda a, b, c: att.varlen_attention(a, b, c, cu, max(ODD), scale)  # noqa: E731
    got = _run(fn, q, k, v, dout)
    want = _run(lambda a, b, c: att.varlen_attention_reference(a, b, c, cu.cpu(), scale),
                *(x.double() for x in (q, k, v, dout)))
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert x.dtype == dtype and x.shape == y.shape and torch.isfinite(x).all(), i
        assert _rel(x, y) <= 1e-2, (i, _rel(x, y))


@gpu
@pytest.mark.gpu
def test_gpu_cudnn_dispatch_and_fallback(monkeypatch):
    monkeypatch.setenv("LORAFUSION_ATTENTION", "cudnn")
    monkeypatch.setattr(att, "_FAILED", set())
    q, k, v, dout, cu = _inputs([100, 37], 8, 2, 128, torch.bfloat16, "cuda")
    ref = att.varlen_attention_reference(q.double(), k.double(), v.double(), cu.cpu(), 0.1)
    assert _rel(att.varlen_attention(q, k, v, cu, 100, 0.1), ref) <= 1e-2

    def boom(*a, **kw):
        raise RuntimeError("cuDNN: no engine")

    import lorafusion.models.cudnn_attention as ca

    monkeypatch.setattr(ca, "cudnn_varlen_attention", boom)
    with pytest.warns(UserWarning, match="cudnn backend failed"):
        out = att.varlen_attention(q, k, v, cu, 100, 0.1)
    assert "cudnn" in att._FAILED and _rel(out, ref) <= 1e-2
