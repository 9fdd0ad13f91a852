"""Fused SwiGLU on Megatron's [gate; up] fc1 output vs the float64 reference (output and gradient), and
what it saves."""

import pytest
import torch

from lorafusion.models.fused.swiglu import SwiGLU, swiglu, swiglu_reference

from ._util import CPU_DTYPES, IMPLS, TOL, device, needs_cuda, rel, saved_bytes

SHAPES = [(7, 66), (4, 1, 128), (3, 2, 2 * 33)]


def _check(impl, dtype, shape, dev):
    g = torch.Generator().manual_seed(0)
    y0 = (torch.randn(shape, generator=g) * 2).to(dtype).to(dev)
    dout = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype).to(dev)
    y = y0.clone().requires_grad_(True)
    out = swiglu(y, impl=impl)
    out.backward(dout)
    yr = y0.double().requires_grad_(True)
    ref = swiglu_reference(yr)
    ref.backward(dout.double())
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel(out, ref) <= TOL[dtype], (impl, dtype, rel(out, ref))
    assert rel(y.grad, yr.grad) <= TOL[dtype], (impl, dtype, rel(y.grad, yr.grad))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(impl, dtype, shape):
    _check(impl, dtype, shape, device())


@pytest.mark.parametrize("impl", IMPLS)
def test_saves_only_the_fc1_output(impl):
    y = torch.randn(5, 1, 64, requires_grad=True)
    nbytes, _ = saved_bytes(lambda t: swiglu(t, impl=impl), y)
    assert nbytes == 5 * 64 * 4
    unfused, _ = saved_bytes(swiglu_reference, y)
    assert unfused == 5 * 64 * 4 + 5 * 32 * 4  # + silu's output


def test_module_and_errors():
    assert SwiGLU(impl="torch")(torch.ones(2, 4)).shape == (2, 2)
    with pytest.raises(ValueError):
        swiglu(torch.ones(2, 5), impl="torch")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(2048, 1, 2 * 14336), (37, 2 * 1000)])
def test_bf16_gpu(impl, shape):
    _check(impl, torch.bfloat16, shape, "cuda")
