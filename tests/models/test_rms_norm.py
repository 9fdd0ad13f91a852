"""Fused RMSNorm vs the float64 HF reference (output and d/dx), saved tensors, and the Megatron module."""

import pytest
import torch

from lorafusion.models.fused.rms_norm import RMSNorm, rms_norm, rms_norm_reference

from ._util import CPU_DTYPES, IMPLS, TOL, device, needs_cuda, rel, saved_bytes

SHAPES = [(3, 1, 64), (17, 100), (5, 2, 48)]


def _check(impl, dtype, shape, dev, eps=1e-5):
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(dev)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype).to(dev)
    dy = torch.randn(shape, generator=g).to(dtype).to(dev)
    x = x0.clone().requires_grad_(True)
    y = rms_norm(x, w, eps, impl=impl)
    y.backward(dy)
    xr = x0.double().requires_grad_(True)
    ref = rms_norm_reference(xr, w.double(), eps)
    ref.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, ref) <= TOL[dtype], (impl, dtype, rel(y, ref))
    assert rel(x.grad, xr.grad) <= TOL[dtype], (impl, dtype, rel(x.grad, xr.grad))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(impl, dtype, shape):
    _check(impl, dtype, shape, device())


def test_triton_saves_only_input_and_rstd():
    x = torch.randn(6, 1, 32, requires_grad=True)
    w = torch.ones(32)
    nbytes, _ = saved_bytes(lambda t: rms_norm(t, w, 1e-5, impl="triton"), x, exclude=(w,))
    assert nbytes == 6 * 32 * 4 + 6 * 4  # x (fp32 here) + fp32 rstd per row


def test_triton_equals_hf_rounding_in_fp16():
    """Llama casting: normalise in fp32, round to the activation dtype, then multiply by the weight."""
    x = (torch.randn(9, 40) * 4).half()
    w = (1 + torch.randn(40) * 0.5).half()
    assert torch.equal(rms_norm(x, w, 1e-6, impl="triton"), rms_norm_reference(x, w, 1e-6))


def test_module_weight_in_params_dtype(megatron_single):
    from lorafusion.core.arch import preset
    from lorafusion.models.spec import transformer_config

    cfg = transformer_config(preset("tiny-llama"), torch.bfloat16)
    norm = RMSNorm(cfg, 64, eps=1e-5, impl="torch")
    assert norm.weight.dtype == torch.bfloat16 and list(norm.state_dict()) == ["weight"]
    assert torch.all(norm.weight == 1)
    with pytest.raises(ValueError):
        rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5, impl="cuda")


def test_frozen_weight_contract():
    with pytest.raises(ValueError, match="frozen"):
        rms_norm(torch.randn(2, 8), torch.ones(8, requires_grad=True), 1e-5, impl="triton")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(2048, 1, 4096), (33, 3000)])
def test_bf16_gpu(impl, shape):
    _check(impl, torch.bfloat16, shape, "cuda")
