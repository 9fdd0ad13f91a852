"""Fused per-token linear cross-entropy vs the float64 reference: loss and d/dhidden under a random per-token
grad_output with ignored labels; chunking; tied embedding weight; frozen-weight contract."""

import pytest
import torch
import torch.nn.functional as F

from lorafusion.models.fused.linear_cross_entropy import (
    default_chunk_tokens,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)

from dispatch_utils import OpWatch

from ._util import CPU_DTYPES, IMPLS, TOL, device, needs_cuda, rel, saved_bytes

SHAPES = [(7, 16, 33, None), (64, 32, 250, 16), (45, 24, 97, 8)]  # tokens, hidden, vocab, chunk_tokens


def _case(n, h, v, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.25] = -100
    labels[0] = -100
    grad_out = torch.rand(n, generator=g) * 3  # non-uniform per-token weights
    return hidden.to(dev), weight.to(dev), labels.to(dev), grad_out.to(dev)


def _check(impl, dtype, n, h, v, chunk, dev):
    hidden, weight, labels, grad_out = _case(n, h, v, dtype, dev)
    x = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, weight, labels, impl=impl, chunk_tokens=chunk)
    (loss * grad_out).sum().backward()
    xr = hidden.double().clone().requires_grad_(True)
    ref = linear_cross_entropy_reference(xr, weight.double(), labels)
    (ref * grad_out.double()).sum().backward()
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert rel(loss, ref) <= TOL[dtype], (impl, dtype, rel(loss, ref))
    assert rel(x.grad, xr.grad) <= TOL[dtype], (impl, dtype, rel(x.grad, xr.grad))
    ignored = labels == -100
    assert torch.all(loss[ignored] == 0) and torch.all(x.grad[ignored] == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n,h,v,chunk", SHAPES)
def test_matches_float64_reference(impl, dtype, n, h, v, chunk):
    _check(impl, dtype, n, h, v, chunk, device())


@pytest.mark.parametrize("impl", IMPLS)
def test_leading_shape_and_no_grad(impl):
    hidden, weight, labels, _ = _case(12, 16, 40, torch.float32, "cpu")
    out = linear_cross_entropy(hidden.view(3, 4, 16), weight, labels.view(3, 4), impl=impl)
    assert out.shape == (3, 4)
    with torch.no_grad():
        again = linear_cross_entropy(hidden, weight, labels, impl=impl, chunk_tokens=5)
    assert torch.allclose(out.view(-1), again, atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_embedding_weight(impl):
    """The output weight is the (frozen) embedding table that also produced the hidden states."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(50, 16)
    emb.weight.requires_grad_(False)
    proj = torch.randn(16, 16, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (20,), generator=g)
    labels = ids.roll(-1)
    labels[-1] = -100
    grad_out = torch.rand(20, generator=g)
    loss = linear_cross_entropy(emb(ids) @ proj, emb.weight, labels, impl=impl, chunk_tokens=7)
    (loss * grad_out).sum().backward()
    p64 = proj.detach().double().requires_grad_(True)
    ref = linear_cross_entropy_reference(F.embedding(ids, emb.weight.double()) @ p64,
                                         emb.weight.double(), labels)
    (ref * grad_out.double()).sum().backward()
    assert rel(loss, ref) <= 1e-5 and rel(proj.grad, p64.grad) <= 1e-5


def test_weight_requiring_grad_is_an_error():
    hidden, weight, labels, _ = _case(4, 8, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match="frozen"):
        linear_cross_entropy(hidden, weight.requires_grad_(True), labels, impl="torch")


def test_only_the_hidden_gradient_is_kept():
    """Saved for backward: G = dL/dh only ([tokens, hidden]), no logits."""
    hidden, weight, labels, _ = _case(40, 16, 300, torch.float32, "cpu")
    nbytes, _ = saved_bytes(lambda x: linear_cross_entropy(x, weight, labels, impl="torch", chunk_tokens=8),
                            hidden.requires_grad_(True), exclude=(weight,))
    assert nbytes == 40 * 16 * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backward_scales_in_one_op(dtype):
    """d/dhidden = G · grad_loss by one op that rounds the fp32 product to G's dtype on store: no fp32
    [tokens, hidden] temporary and no cast kernel after it; bit-identical to ``(G.float() * s).to(dtype)``."""
    hidden, weight, labels, grad_out = _case(33, 16, 50, dtype, "cpu", seed=2)
    x = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, weight, labels, impl="torch", chunk_tokens=8)
    loss.backward(torch.ones_like(loss), retain_graph=True)
    g = x.grad.clone()  # G itself (scaled by 1)
    x.grad = None
    with OpWatch(flagged=_ELEMENTWISE) as watch:
        loss.backward(grad_out)
    assert watch.seen == ["aten.mul.out"], watch.seen
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, (g.float() * grad_out[:, None]).to(dtype))


_ELEMENTWISE = frozenset({"aten.mul.Tensor", "aten.mul.out", "aten._to_copy.default", "aten.copy_.default",
                          "aten.clone.default"})


def test_default_chunk_is_bounded():
    c = default_chunk_tokens(128256)
    assert c % 64 == 0 and 4 * c * 128256 <= (1 << 30) and c >= 1024
    assert default_chunk_tokens(10**9) == 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,h,v,chunk", [(300, 256, 5000, 128), (1000, 128, 32003, None)])
def test_bf16_gpu(impl, n, h, v, chunk):
    _check(impl, torch.bfloat16, n, h, v, chunk, "cuda")
