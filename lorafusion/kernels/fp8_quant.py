"""Row-wise FP8 quantization in one kernel (the CUDA path of :func:`lorafusion.ops.fp8_linear.quantize_rows`).

For each row ``i`` of ``x`` [m, n] (times ``col_scale`` [n] when given):

    v = x[i, :] (· col_scale) ;  scale[i] = max(max|v|, eps) / fp8_max ;  q[i, :] = clamp(v / scale[i]) → fp8

One program per row: a first loop over the row finds max|v|, a second writes q (the row is read twice, the
second time mostly from L2). Division is IEEE (``div_rn``) so that q equals the torch path's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quant_rows_kernel(x_ptr, cs_ptr, q_ptr, s_ptr, N, stride_x, stride_q,
                       QMAX: tl.constexpr, EPS: tl.constexpr, HAS_CS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CS:
            v = v * tl.load(cs_ptr + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / QMAX
    tl.store(s_ptr + row, scale)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CS:
            v = v * tl.load(cs_ptr + cols, mask=mask, other=0.0)
        q = tl.math.div_rn(v, scale)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor, dtype: torch.dtype, col_scale: torch.Tensor | None = None,
                         eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, n] ``dtype``, scale [m, 1] float32) for a 2-D CUDA tensor ``x`` whose last dim is contiguous."""
    m, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, n, device=x.device, dtype=dtype)
    s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m == 0:
        return q, s
    block = min(4096, triton.next_power_of_2(n))
    cs = col_scale if col_scale is not None else s
    _quant_rows_kernel[(m,)](x, cs, q, s, n, x.stride(0), q.stride(0), QMAX=float(torch.finfo(dtype).max),
                             EPS=eps, HAS_CS=col_scale is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return q, s
