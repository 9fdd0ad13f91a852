"""FP8 frozen base linear: ``Y = X·Wᵀ`` with W stored once in float8_e4m3fn, no weight gradient.

Quantization (row-wise, "dequant" scales: ``v ≈ q·scale``):

- W [n, k] is quantized once (at model build / HF import) per output channel: ``W ≈ diag(s_w)·W_q``,
  ``s_w = max_j |W[i, j]| / 448``; the bf16 copy is then freed (``lorafusion.layers.fp8_base``).
- Forward: X [m, k] is quantized per row on the fly (``X ≈ diag(s_x)·X_q``) and
  ``Y = diag(s_x)·(X_q·W_qᵀ)·diag(s_w)`` is one ``torch._scaled_mm`` (rowwise scales, fp32 accumulation,
  output in X's dtype).
- Backward: ``dX = dY·W = (dY·diag(s_w))·W_q``: the per-output-channel scale is folded into dY, which is then
  quantized per row (``GRAD_DTYPE``: e4m3 by default, e5m2 on request; measured in docs/BENCHMARKS.md) and
  multiplied by W_q with a unit column scale. W_q's transpose (the K-major operand that FP8 GEMMs need for
  this product) is made for the call (one Triton kernel on CUDA) and dropped, so the base keeps one byte per
  weight (:class:`Fp8Weight` can keep it instead: one byte more per weight for one launch less per
  backward). Nothing of X is saved for backward; no dW is computed (W is not a parameter).

What never changes between calls (W is frozen) is made once per weight in an :class:`Fp8Weight`: the
operand views of both GEMMs, the scale rows, the unit scale. The layers keep one per linear
(:func:`lorafusion.layers.fp8_base.weight_form`), remade when the weight is rewritten; the op functions make
one per call when given none.

``torch._scaled_mm`` (cuBLASLt on sm_89+, and CPU in torch >= 2.13, which CI uses) wants K and N multiples
of 16; other shapes take :func:`scaled_gemm`'s fallback, the same quantized math as a float32 matmul of the
dequantized operands (slower, same numbers up to fp32 summation order). X's row quantization runs as one
Triton kernel on CUDA (:mod:`lorafusion.kernels.fp8_quant`) and in
torch elsewhere.

:func:`fp8_linear_reference` is the ground truth: the same quantization, the GEMM in float64.
"""

from __future__ import annotations

import torch

from lorafusion.core.errors import ConfigError

__all__ = ["E4M3", "E5M2", "GRAD_DTYPE", "Fp8BaseLinear", "Fp8Weight", "fp8_linear", "fp8_linear_reference",
           "quantize_rows", "quantize_rows_torch", "quantize_weight", "dequantize", "scaled_gemm",
           "transpose", "check_fp8_device", "unit_scale"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
GRAD_DTYPE = E4M3  # dY's FP8 type in the input-gradient GEMM (e4m3 vs e5m2: docs/BENCHMARKS.md, FP8 base)
EPS = 1e-12  # smallest row amax: an all-zero row gets a tiny scale and q = 0
ALIGN = 16  # torch._scaled_mm: K and N multiples of 16
# The forward GEMM uses Hopper's fast FP8 accumulation (use_fast_accum) when its K is at most this (0: never);
# measured per shape in docs/results/fp8-8b-1gpu.json ("layers"). The input-gradient GEMM always accumulates
# in full fp32.
FWD_FAST_ACCUM_MAX_K = 0


def quantize_rows_torch(x: torch.Tensor, dtype: torch.dtype = E4M3, col_scale: torch.Tensor | None = None):
    """(q [m, n] ``dtype``, scale [m, 1] float32) with ``x·diag(col_scale) ≈ diag(scale)·q`` for 2-D ``x``:
    per row ``a = max(max|v|, EPS)``, ``scale = a / qmax``, ``q = clamp(v · (qmax / a))`` (one multiply per
    element by the row's reciprocal, as the CUDA kernel does; both divisions tensor by tensor, so IEEE-rounded
    on every device: torch divides by a Python number as a multiply by its reciprocal on CUDA)."""
    v = x.float()
    if col_scale is not None:
        v = v * col_scale.float().view(1, -1)
    a = v.abs().amax(dim=1, keepdim=True).clamp(min=EPS)
    qmax = torch.full_like(a, torch.finfo(dtype).max)
    q = (v * (qmax / a)).clamp(-qmax, qmax).to(dtype)
    return q, a / qmax


_TRITON: dict = {}


def _triton(name: str):
    """The CUDA kernel launcher ``name`` of :mod:`lorafusion.kernels.fp8_quant`, looked up once (None without
    Triton: the torch path)."""
    if name not in _TRITON:
        try:
            from lorafusion.kernels import fp8_quant
        except ImportError:
            _TRITON[name] = None
        else:
            _TRITON[name] = getattr(fp8_quant, name)
    return _TRITON[name]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3, col_scale: torch.Tensor | None = None):
    """Row-wise quantization (see :func:`quantize_rows_torch`): one Triton kernel on CUDA, torch elsewhere."""
    if _on_device(x):
        fn = _triton("quantize_rows_triton")
        if fn is not None:
            return fn(x, dtype, col_scale, EPS)
    return quantize_rows_torch(x, dtype, col_scale)


def transpose(w_q: torch.Tensor) -> torch.Tensor:
    """``w_q.t().contiguous()``: one Triton kernel on CUDA (torch's copy of FP8 is slow there), torch
    elsewhere."""
    if _on_device(w_q) and w_q.stride(1) == 1:
        fn = _triton("transpose_triton")
        if fn is not None:
            return fn(w_q)
    return w_q.t().contiguous()


_UNIT: dict = {}


def unit_scale(n: int, device) -> torch.Tensor:
    """A [1, n] float32 tensor of ones (the column scale of a GEMM whose scale is folded elsewhere), made once
    per (n, device) rather than per backward call."""
    key = (n, str(device))
    if key not in _UNIT:
        _UNIT[key] = torch.ones(1, n, device=device, dtype=torch.float32)
    return _UNIT[key]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q [n, k] float8_e4m3fn, row-major; s_w [n] float32): one scale per output channel."""
    q, s = quantize_rows_torch(weight.detach(), E4M3)
    return q.contiguous(), s.view(-1).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``diag(scale)·q`` in ``dtype`` (``scale`` [m] or [m, 1])."""
    return q.to(dtype) * scale.to(dtype).view(-1, 1)


def scaled_gemm(a_q: torch.Tensor, s_a: torch.Tensor, b_q: torch.Tensor, s_b: torch.Tensor,
                out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """``diag(s_a)·(a_q·b_qᵀ)·diag(s_b)`` for row-major a_q [m, K], b_q [N, K] (both K-major), s_a [m, 1],
    s_b [1, N] float32. ``torch._scaled_mm`` when K and N are multiples of 16, else the same math in
    float32."""
    return _scaled_mm(a_q, s_a, b_q.t(), s_b, out_dtype, use_fast_accum)


def _scaled_mm(a_q, s_a, b_kn, s_b, out_dtype, use_fast_accum=False) -> torch.Tensor:
    """:func:`scaled_gemm` with the second operand given as ``b_qᵀ`` ([K, N], column-major)."""
    K, N = b_kn.shape
    if K % ALIGN == 0 and N % ALIGN == 0:
        return torch._scaled_mm(a_q, b_kn, scale_a=s_a, scale_b=s_b, out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum)
    a = a_q.float() * s_a
    b = b_kn.float() * s_b
    return (a @ b).to(out_dtype)


class Fp8Weight:
    """An FP8 weight (W_q [n, k] row-major, s_w [n]) and the forms of it that both GEMMs take, made once.

    ``fwd_b`` = W_qᵀ as a view ([k, n], column-major: the forward's K-major operand), ``fwd_scale`` = s_w as
    a [1, n] row, ``unit`` = the [1, k] column scale of the input-gradient GEMM, ``triton``: whether the
    transpose of W_q runs as the Triton kernel (CUDA, contiguous rows). ``transposed``: also keep W_q's
    transpose (``dx_b``, the input gradient's K-major operand, [n, k] column-major) instead of making it in
    each backward: one byte more per weight. :meth:`fresh` says whether this still describes
    ``(w_q, w_scale)`` (same tensors, not written since)."""

    __slots__ = ("q", "scale", "fwd_b", "fwd_scale", "unit", "triton", "dx_b", "_versions")

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, transposed: bool = False):
        self.q, self.scale = w_q, w_scale
        self.fwd_b = w_q.t()
        self.fwd_scale = w_scale.view(1, -1)
        self.unit = unit_scale(w_q.shape[1], w_q.device)
        self.triton = _on_device(w_q) and w_q.stride(1) == 1
        self.dx_b = self._transposed_b() if transposed else None
        self._versions = (w_q._version, w_scale._version)

    def fresh(self, w_q: torch.Tensor, w_scale: torch.Tensor) -> bool:
        return (self.q is w_q and self.scale is w_scale
                and self._versions == (w_q._version, w_scale._version))

    def _transposed_b(self) -> torch.Tensor:
        """W_q in column-major layout ([n, k], strides (1, n)): the data of W_qᵀ, a new tensor."""
        if self.triton:
            fn = _triton("transposed_operand")
            if fn is not None:
                return fn(self.q)
        return transpose(self.q).t()

    def dx_operand(self) -> torch.Tensor:
        """The input-gradient GEMM's K-major weight operand: the kept one, or one made for this call."""
        return self.dx_b if self.dx_b is not None else self._transposed_b()


def _on_device(t: torch.Tensor) -> bool:
    """Whether the helpers take their Triton (CUDA) branch for ``t``."""
    return t.is_cuda


def fp8_matmul(x2d: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``X·Wᵀ`` in x's dtype: X quantized per row (e4m3), then the scaled FP8 GEMM with W's channel scales."""
    x_q, s_x = quantize_rows(x2d, E4M3)
    return _scaled_mm(x_q, s_x, w.fwd_b, w.fwd_scale, x2d.dtype, x2d.shape[1] <= FWD_FAST_ACCUM_MAX_K)


def fp8_input_grad(dy: torch.Tensor, w: Fp8Weight, grad_dtype: torch.dtype) -> torch.Tensor:
    """``dX = dY·W`` in dy's dtype: ``dY·diag(s_w)`` quantized per row to ``grad_dtype``, times W_q."""
    g_q, s_g = quantize_rows(dy, grad_dtype, col_scale=w.scale)  # dY·diag(s_w), per row
    return _scaled_mm(g_q, s_g, w.dx_operand(), w.unit, dy.dtype)


class Fp8BaseLinear(torch.autograd.Function):
    """``Y = X·Wᵀ`` with X quantized per row and W given as an :class:`Fp8Weight`; gradient for X only. The
    weight stays on ctx (frozen: nothing for autograd to save or check)."""

    @staticmethod
    def forward(ctx, x2d, w: Fp8Weight, grad_dtype):
        ctx.w, ctx.grad_dtype = w, grad_dtype
        return fp8_matmul(x2d, w)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return fp8_input_grad(dy, ctx.w, ctx.grad_dtype), None, None


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               grad_dtype: torch.dtype | None = None, *, form: Fp8Weight | None = None) -> torch.Tensor:
    """``X·Wᵀ (+bias)`` for ``x`` [..., k] with the FP8 weight (W_q [n, k], s_w [n]); output in x's dtype.
    ``form``: the weight's :class:`Fp8Weight`, if the caller keeps one (else one is made for the call)."""
    if x.is_cuda and x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_linear: CUDA row-wise FP8 GEMMs write bfloat16; got an input of {x.dtype}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    w = form if form is not None else Fp8Weight(w_q, w_scale)
    y = Fp8BaseLinear.apply(x2d, w, grad_dtype or GRAD_DTYPE)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])


def fp8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The quantized GEMM in float64: ``dequant(quant_rows(X))·dequant(W)ᵀ`` (no autograd)."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    x_q, s_x = quantize_rows_torch(x2d, E4M3)
    y = dequantize(x_q, s_x) @ dequantize(w_q, w_scale).t()
    return y.reshape(*x.shape[:-1], y.shape[-1])


def check_fp8_device(device: torch.device | str | None, where: str = "model.base_precision") -> None:
    """One clear error when ``device`` is a CUDA GPU without FP8 tensor cores (before sm_89)."""
    if device is None or torch.device(device).type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"{where}: fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                          f"Hopper or newer); {name} is sm_{major}{minor} — use base_precision: bf16")
