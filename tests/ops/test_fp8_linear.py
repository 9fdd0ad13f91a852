"""FP8 base linear (lorafusion.ops.fp8_linear): quantization round trip, the forward against a float64
reference of the quantized GEMM, the input gradient against the dequantized reference, no weight gradient, odd
shapes (the float32 fallback), the device check. On CPU through torch._scaled_mm (torch >= 2.13); the CUDA
path in the gpu-marked tests at the end."""

from __future__ import annotations

import pytest
import torch

from lorafusion.core.errors import ConfigError
from lorafusion.ops import fp8_linear as F

# (m, k, n); the last two: fallback
SHAPES = [(32, 64, 48), (7, 128, 96), (1, 32, 16), (33, 20, 7), (5, 48, 30)]
FP8 = [F.E4M3, F.E5M2]


def _data(m, k, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)  # rows of unequal size
    w = (torch.randn(n, k, generator=g) * 0.02 * torch.rand(n, 1, generator=g)).to(dtype)
    return x, w


def _spacing_bound(v: torch.Tensor, dtype) -> torch.Tensor:
    """Half the FP8 spacing at |v| (v in units of the row's scale): round-to-nearest error bound."""
    fi = torch.finfo(dtype)
    mant = 3 if dtype == F.E4M3 else 2
    min_normal = fi.smallest_normal
    exp = torch.floor(torch.log2(v.abs().clamp(min=min_normal)))
    return 2.0 ** (exp - mant) / 2


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_quantize_rows_round_trip(m, k, n, src, dtype):
    x, _ = _data(m, k, n, src)
    x[0] = 0  # an all-zero row: q = 0, a finite scale
    q, s = F.quantize_rows(x, dtype)
    assert q.dtype == dtype and s.shape == (m, 1) and s.dtype == torch.float32 and torch.isfinite(s).all()
    assert (q[0].float() == 0).all()
    v = x.double() / s.double()
    err = (q.double() - v).abs()
    assert (err <= _spacing_bound(v, dtype) * (1 + 1e-6)).all()
    # the row's largest element maps to the format's largest value
    rows = x.double().abs().amax(1) > 0
    top = q.double().abs().amax(1)
    assert torch.allclose(top[rows], torch.full_like(top[rows], torch.finfo(dtype).max), rtol=2 ** -4)
    deq = F.dequantize(q, s)
    torch.testing.assert_close(deq, x.double(), rtol=2 ** -(3 if dtype == F.E4M3 else 2),
                               atol=float(s.max()) * 2 ** -9)


def test_column_scale_is_folded_before_the_row_scale():
    x, _ = _data(9, 32, 8, torch.float32)
    c = torch.rand(32) + 0.5
    q1, s1 = F.quantize_rows(x, F.E4M3, col_scale=c)
    q2, s2 = F.quantize_rows(x * c, F.E4M3)
    assert torch.equal(q1.float(), q2.float()) and torch.equal(s1, s2)


def test_quantize_weight_per_output_channel():
    _, w = _data(4, 64, 40)
    q, s = F.quantize_weight(w)
    assert q.dtype == F.E4M3 and q.shape == w.shape and q.is_contiguous() and s.shape == (40,)
    torch.testing.assert_close(s.double(), w.double().abs().amax(1) / 448, rtol=1e-6, atol=0)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_equals_float64_reference_of_the_quantized_gemm(m, k, n, dtype):
    x, w = _data(m, k, n, dtype)
    q, s = F.quantize_weight(w)
    y = F.fp8_linear(x, q, s)
    ref = F.fp8_linear_reference(x, q, s)
    assert y.dtype == dtype and y.shape == (m, n)
    # same quantized operands: only fp32 summation order and the output rounding differ
    tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    # and the quantized GEMM is within e4m3's error of the exact product
    exact = x.double() @ w.double().t()
    assert float((ref - exact).norm() / exact.norm()) < 0.06


def test_bias_and_leading_dims():
    x, w = _data(12, 32, 16)
    q, s = F.quantize_weight(w)
    b = torch.randn(16).to(torch.bfloat16)
    y = F.fp8_linear(x.view(3, 4, 32), q, s, b)
    assert y.shape == (3, 4, 16)
    torch.testing.assert_close(y.view(12, 16), F.fp8_linear(x, q, s) + b)


@pytest.mark.parametrize("grad", FP8)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_input_gradient_equals_dequantized_reference(m, k, n, grad):
    x, w = _data(m, k, n, torch.float32)
    q, s = F.quantize_weight(w)
    x.requires_grad_(True)
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    F.fp8_linear(x, q, s, grad_dtype=grad).backward(dy)
    g_q, s_g = F.quantize_rows_torch(dy, grad, col_scale=s)  # dY·diag(s_w), quantized per row
    ref = F.dequantize(g_q, s_g) @ q.double()
    torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = dy.double() @ w.double()
    assert float((ref - exact).norm() / exact.norm()) < (0.06 if grad == F.E4M3 else 0.12)


def test_no_weight_gradient_and_one_gemm_each_way(monkeypatch):
    x, w = _data(16, 32, 16)
    q, s = F.quantize_weight(w)
    calls = []
    real = F._scaled_mm
    monkeypatch.setattr(F, "_scaled_mm", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x.requires_grad_(True)
    F.fp8_linear(x, q, s).sum().backward()
    assert calls == [(16, 32), (16, 16)]  # X·W_qᵀ, then dY·W_q: no dW GEMM
    assert q.grad is None and s.grad is None and not q.requires_grad
    calls.clear()
    x2 = x.detach()  # no input gradient wanted: backward never runs the op
    y = F.fp8_linear(x2, q, s)
    assert not y.requires_grad and calls == [(16, 32)]


def test_device_check_names_the_field_and_the_gpu(monkeypatch):
    F.check_fp8_device(None)
    F.check_fp8_device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"model.base_precision: fp8 needs .*8\.9.*A100.*sm_80"):
        F.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    F.check_fp8_device(torch.device("cuda", 0))


# ----------------------------------------------------------------------------------------- CUDA (Hopper)
def _cuda_fp8():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs an sm_89+ GPU")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("m,n", [(1, 16), (257, 4096), (4096, 14336), (33, 20)])
def test_triton_row_quantization_equals_torch(m, n, dtype):
    x = (torch.randn(m, n, device="cuda") * 3).to(torch.bfloat16)
    c = torch.rand(n, device="cuda") + 0.5
    for cs in (None, c):
        q, s = F.quantize_rows(x, dtype, cs)
        q_ref, s_ref = F.quantize_rows_torch(x, dtype, cs)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # bit for bit


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs an sm_89+ GPU")
@pytest.mark.parametrize("m,k,n", [(3, 4096, 6144), (2048, 4096, 28672), (1000, 14336, 4096), (64, 20, 7)])
def test_cuda_forward_and_input_gradient_against_float64(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    q, s = F.quantize_weight(w)
    y = F.fp8_linear(x, q, s)
    ref = F.fp8_linear_reference(x, q, s)
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    y.backward(dy)
    g_q, s_g = F.quantize_rows_torch(dy, F.GRAD_DTYPE, col_scale=s)
    dref = F.dequantize(g_q, s_g) @ q.double()
    torch.testing.assert_close(x.grad.double(), dref, rtol=2 ** -7, atol=2 ** -7 * float(dref.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs an sm_89+ GPU")
# 4096: 4 rows a program by default (the 1001st row alone in its program); 28672: 8k blocks
@pytest.mark.parametrize("m,n", [(1, 16), (70, 130), (1001, 4096), (4096, 14336), (256, 28672)])
def test_triton_transpose_and_two_pass_quantization(m, n):
    from lorafusion.kernels.fp8_quant import quantize_rows_triton, transposed_operand

    w = torch.randint(0, 255, (m, n), dtype=torch.uint8, device="cuda").view(F.E4M3)
    assert torch.equal(F.transpose(w).view(torch.uint8), w.view(torch.uint8).t().contiguous())
    b = transposed_operand(w)  # column-major W: the input gradient's operand
    assert b.dtype == F.E4M3 and b.stride() == (1, m)
    assert torch.equal(b.view(torch.uint8), w.view(torch.uint8))
    x = (torch.randn(m, n, device="cuda") * 3).to(torch.bfloat16)
    one, s1 = quantize_rows_triton(x, F.E4M3)
    two, s2 = quantize_rows_triton(x, F.E4M3, max_single=64)  # the two-loop path
    assert torch.equal(s1, s2) and torch.equal(one.view(torch.uint8), two.view(torch.uint8))
    # the whole row from registers
    wide, s3 = quantize_rows_triton(x, F.E4M3, max_single=1 << 16, num_warps=32)
    assert torch.equal(s1, s3) and torch.equal(one.view(torch.uint8), wide.view(torch.uint8))
    if n <= 8192:  # several rows a program
        four, s4 = quantize_rows_triton(x, F.E4M3, rows=4)
        assert torch.equal(s1, s4) and torch.equal(one.view(torch.uint8), four.view(torch.uint8))


@pytest.mark.parametrize("m,k,n", [(32, 64, 48), (33, 20, 7)])
def test_forward_and_input_gradient_against_the_original_weight_with_channels_over_six_decades(m, k, n):
    """Against float64 products of the ORIGINAL weight (not its dequantized copy), with output channels whose
    magnitudes span 1e-3..1e3: a scale applied on the wrong axis (or not at all) in Y or dX is off by orders
    of magnitude here, while a reference that reuses the op's own quantization convention would not see it."""
    g = torch.Generator().manual_seed(7)
    chan = torch.logspace(-3, 3, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
    w = (torch.randn(n, k, generator=g, dtype=torch.float64) * chan.view(-1, 1)).float()
    x = torch.randn(m, k, generator=g).requires_grad_(True)
    dy = torch.randn(m, n, generator=g) / chan.float().view(1, -1)  # every channel contributes to dX alike
    q, s = F.quantize_weight(w)
    y = F.fp8_linear(x, q, s)
    y.backward(dy)
    y_ref = x.detach().double() @ w.double().t()
    per_channel = (y.double() - y_ref).norm(dim=0) / y_ref.norm(dim=0)
    assert float(per_channel.max()) < 0.1, per_channel
    dx_ref = dy.double() @ w.double()
    assert float((x.grad.double() - dx_ref).norm() / dx_ref.norm()) < 0.06


def test_row_kernel_launch_choice():
    """The measured launch per row length (kernels/fp8_quant.py): 4 rows a program for 4096-column rows
    without a column scale, 2 with it; two loops of 2k blocks for 4k-8k columns with a column scale, of 4k
    blocks from 16k columns; explicit arguments override."""
    from lorafusion.kernels.fp8_quant import launch

    assert launch(4096, False) == (True, 4096, 4, 16)
    assert launch(4096, True) == (True, 4096, 2, 8)
    assert launch(6144, True) == (False, 2048, 1, 8)
    assert launch(6144, False) == (True, 8192, 1, 8)
    assert launch(64, False) == (True, 64, 1, 4)
    assert launch(4096, False, rows=1) == (True, 4096, 1, 8)  # check_fp8.py's reference launch
    assert launch(14336, False) == (False, 4096, 1, 8)
    assert launch(28672, True) == (False, 4096, 1, 16)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU: Triton's interpreter (the GPU test above checks q)")
# max_single, rows: one read: a row / 4 rows a program (6 rows: the last program half empty); two loops
@pytest.mark.parametrize("max_single,rows", [(8192, 1), (8192, 4), (32, 1)])
@pytest.mark.parametrize("col_scale", [False, True])
@pytest.mark.parametrize("src", [torch.float32, torch.float16])
def test_triton_row_kernel_scales_on_cpu(src, col_scale, max_single, rows):
    """The row kernel's loads (times the column scale) and max|v| in the interpreter: scales equal the torch
    path's bit for bit. (q is not compared here: the interpreter's float→fp8 cast does not round to
    nearest.)"""
    from lorafusion.kernels.fp8_quant import quantize_rows_triton

    x, _ = _data(6, 70, 8, src)
    x[2] = 0
    c = torch.rand(70, generator=torch.Generator().manual_seed(4)) + 0.5 if col_scale else None
    q, s = quantize_rows_triton(x, F.E4M3, c, F.EPS, max_single=max_single, rows=rows)
    _, s_ref = F.quantize_rows_torch(x, F.E4M3, c)
    assert q.shape == x.shape and q.dtype == F.E4M3 and torch.equal(s, s_ref)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU: Triton's interpreter (the GPU test above checks q)")
# default launches: 4 rows a program (4096), one row (4096 with a column scale, 6144), two loops (70 of 32)
@pytest.mark.parametrize("n,max_single", [(4096, 8192), (6144, 8192), (70, 32)])
@pytest.mark.parametrize("col_scale", [False, True])
def test_triton_row_kernel_values_before_the_cast_equal_torch_on_cpu(n, max_single, col_scale):
    """The kernel's q before the FP8 cast (written as float32) equals torch's clamp(v · (qmax / a)) bit for
    bit on every path (one multiply by the row's IEEE reciprocal; the former per-element division differs in
    a share of the elements), and the scales equal quantize_rows_torch's."""
    from lorafusion.kernels.fp8_quant import quantize_rows_triton

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(6, n, generator=g) * 3).to(torch.bfloat16)
    x[2] = 0
    c = torch.rand(n, generator=g) + 0.5 if col_scale else None
    v = x.float() * (c.view(1, -1) if col_scale else 1)
    a = v.abs().amax(1, keepdim=True).clamp(min=F.EPS)
    qmax = torch.full_like(a, 448.0)
    q, s = quantize_rows_triton(x, torch.float32, c, F.EPS, max_single=max_single, qmax=448.0)
    assert torch.equal(q, (v * (qmax / a)).clamp(-qmax, qmax))
    assert torch.equal(s, F.quantize_rows_torch(x, F.E4M3, c)[1])
    divided, _ = quantize_rows_triton(x, torch.float32, c, F.EPS, max_single=max_single, qmax=448.0,
                                      divide=True)
    assert not torch.equal(divided, q)  # the test tells the two apart


def test_reference_rounds_both_divisions_and_multiplies_each_element_by_the_reciprocal():
    """quantize_rows_torch: scale = a / qmax and q = RNE(v · (qmax / a)), each division IEEE-rounded in
    float32. Rows of a max a and elements within 3 float32 ulps of FP8 rounding midpoints (times the scale),
    where a per-element division v / scale rounds some of them the other way."""
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(64, 1, generator=g) * 10 + 0.1
    mids = torch.tensor([1.0625, 1.1875, 3.25, 5.5, 13.0, 100.0, 208.0, 0.53125])  # e4m3 midpoints
    near = (mids.view(1, -1) * amax / 448.0).view(torch.int32).unsqueeze(-1) + torch.arange(-3, 4)
    x = torch.cat([amax, near.view(torch.float32).view(64, -1)], dim=1)
    q, s = F.quantize_rows_torch(x, F.E4M3)
    a, qmax = amax.double(), 448.0
    scale = (a / qmax).float()  # float64 quotient of float32 operands, then one rounding: the IEEE quotient
    inv = (qmax / a).float()
    assert torch.equal(s, scale)
    assert torch.equal(q.view(torch.uint8), (x * inv).clamp(-qmax, qmax).to(F.E4M3).view(torch.uint8))
    divided = (x / scale).clamp(-qmax, qmax).to(F.E4M3)
    assert not torch.equal(q.view(torch.uint8), divided.view(torch.uint8))  # the test tells the two apart


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU: Triton's interpreter (the GPU test above checks q)")
def test_triton_row_kernel_default_launch_of_4096_columns_on_cpu():
    """The default launch of 4096-column rows (4 rows a program; 6 rows: the second program half empty) in the
    interpreter: scales equal the torch path's bit for bit."""
    from lorafusion.kernels.fp8_quant import quantize_rows_triton

    x, _ = _data(6, 4096, 8, torch.float32)
    q, s = quantize_rows_triton(x, F.E4M3, None, F.EPS)
    _, s_ref = F.quantize_rows_torch(x, F.E4M3)
    assert q.shape == x.shape and torch.equal(s, s_ref)


# ------------------------------------------------------------------------- the weight's forms, made once
class _WeightOps:
    """A dispatch mode recording the ops that touch the storage of any of ``tensors``."""

    def __init__(self, *tensors):
        from torch.utils._python_dispatch import TorchDispatchMode

        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        seen: list[str] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                flat = [*args, *(kwargs or {}).values()]
                if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in ptrs for a in flat):
                    seen.append(str(func).split(".")[1])
                return func(*args, **(kwargs or {}))

        self.mode, self.seen = Mode(), seen


@pytest.mark.parametrize("transposed", [False, True])
def test_a_kept_weight_form_leaves_the_gemms_alone_to_touch_the_weight(transposed):
    """Per call, with the weight's form made once: the forward GEMM reads W_q (its operand view made once, no
    per-call view), and backward reads W_q only to transpose it — not at all when the form keeps the
    transpose. (Before the form, each call also made W_q's and s_w's operand views.)"""
    x, w = _data(16, 32, 48, torch.float32)
    q, s = F.quantize_weight(w)
    form = F.Fp8Weight(q, s, transposed=transposed)
    x.requires_grad_(True)
    dy = torch.randn(16, 48, generator=torch.Generator().manual_seed(1))
    watch = _WeightOps(q)
    with watch.mode:
        F.fp8_linear(x, q, s, form=form).backward(dy)
    assert watch.seen == (["_scaled_mm"] if transposed else ["_scaled_mm", "t", "clone"])
    x2 = x.detach().clone().requires_grad_(True)
    y2 = F.fp8_linear(x2, q, s)  # a form made for the call: the same numbers
    y2.backward(dy)
    assert torch.equal(F.fp8_linear(x, q, s, form=form), y2) and torch.equal(x.grad, x2.grad)


def test_the_kept_transpose_is_the_weights_and_a_form_knows_when_it_is_stale():
    _, w = _data(4, 48, 32)
    q, s = F.quantize_weight(w)
    form = F.Fp8Weight(q, s, transposed=True)
    b = form.dx_operand()
    assert b.shape == (32, 48) and b.stride() == (1, 32) and b.dtype == F.E4M3
    assert torch.equal(b.view(torch.uint8), q.view(torch.uint8))  # W_q itself, column-major
    assert form.dx_operand() is b  # kept, not remade
    made = F.Fp8Weight(q, s).dx_operand()
    assert made.stride() == (1, 32) and torch.equal(made.view(torch.uint8), q.view(torch.uint8))
    assert form.fresh(q, s)
    assert not form.fresh(q.clone(), s) and not form.fresh(q, s.clone())  # other tensors
    q2, s2 = F.quantize_weight(w * 2)
    q.copy_(q2)  # written in place: stale
    assert not form.fresh(q, s)
    form = F.Fp8Weight(q, s, transposed=True)
    s.copy_(s2)
    assert not form.fresh(q, s)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: Triton's interpreter (the GPU test checks it)")
@pytest.mark.parametrize("m,n", [(1, 16), (70, 130), (64, 64)])
def test_triton_transposed_operand_on_cpu(m, n):
    """The CUDA transpose that the input gradient's operand comes from, in the interpreter: W_q's bytes in
    column-major layout, as FP8."""
    from lorafusion.kernels.fp8_quant import transposed_operand

    w = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(m))
    b = transposed_operand(w.view(F.E4M3))  # every byte, NaN patterns included, moved as it is
    assert b.dtype == F.E4M3 and b.shape == (m, n) and b.stride() == (1, m)
    assert torch.equal(b.view(torch.uint8), w)
