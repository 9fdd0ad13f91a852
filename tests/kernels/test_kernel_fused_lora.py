"""Single-adapter FusedLoRA vs the torch reference (interpreter on CPU: fp32/fp16; the GPU file covers
bf16)."""

import pytest
import torch

from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed
from lorafusion.ops.fused import fused_lora_delta, fused_lora_linear, multi_lora_linear_fused

from ._util import make_adapters, reference_linear, rel, run_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 dots are IEEE while torch's float32 matmul precision is "highest" (the default), on the GPU too
TOL32 = 1e-5


@pytest.mark.parametrize("dtype,p,bias,shape", [
    (torch.float32, 0.0, True, (37,)),
    (torch.float32, 0.25, False, (7, 5)),  # Megatron [s, b, h]
    (torch.float16, 0.1, True, (33,)),
])
def test_fused_lora_linear_matches_reference(dtype, p, bias, shape):
    torch.manual_seed(0)
    k, n, r = 45, 39, 5
    x = torch.randn(*shape, k, dtype=dtype, device=DEV).requires_grad_(True)
    W = torch.randn(n, k, dtype=dtype, device=DEV) / k**0.5
    b = torch.randn(n, dtype=dtype, device=DEV).requires_grad_(True) if bias else None
    A, B = make_adapters(k, n, [r], dtype, DEV)
    m = x.numel() // k
    routing = Routing.single(m)
    g = torch.randn(*shape, n, dtype=dtype, device=DEV)
    args = (x, W, b, A, B, [1.7], [p], [mix_seed(1)], routing, g)
    y, grads = run_linear(multi_lora_linear_fused, *args)
    y_ref, grads_ref = run_linear(reference_linear, *args)
    tol = TOL32 if dtype == torch.float32 else 5e-3
    assert y.shape == y_ref.shape
    assert rel(y, y_ref) < tol
    for got, want in zip(grads, grads_ref, strict=True):
        if want is None:
            assert got is None
        else:
            assert rel(got, want) < tol


def test_non_contiguous_input_and_single_entry_points():
    torch.manual_seed(1)
    k, n, r, m = 40, 24, 16, 19
    base = torch.randn(k, m, device=DEV)
    x = base.t().requires_grad_(False)  # non-contiguous view [m, k]
    x = x.detach().requires_grad_(True)
    assert not x.is_contiguous()
    W = torch.randn(n, k, device=DEV)
    A, B = make_adapters(k, n, [r], torch.float32, DEV)
    y = fused_lora_linear(x, W, None, A[0], B[0], 0.5, 0.2, 99)
    y_ref = reference_linear(x, W, None, A, B, [0.5], [0.2], [99], Routing.single(m))
    assert rel(y, y_ref) < TOL32
    d = fused_lora_delta(x, A[0], B[0], 0.5, 0.2, 99)
    assert rel(d, y_ref - torch.nn.functional.linear(x, W)) < TOL32


def test_fp32_dot_precision_follows_torch():
    from lorafusion.kernels.fused_multi_lora import dot_precision

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert [dot_precision(t)
                for t in (torch.float32, torch.bfloat16, torch.float16)] == ["ieee", "tf32", "tf32"]
        torch.set_float32_matmul_precision("high")
        assert dot_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
