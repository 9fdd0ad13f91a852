"""FP8 helpers of the FP8 base linear on CUDA (:mod:`lorafusion.ops.fp8_linear`): row-wise quantization and
the transpose of an FP8 weight.

Row-wise quantization, for each row ``i`` of ``x`` [m, n] (times ``col_scale`` [n] when given):

    v = x[i, :] (· col_scale) ;  a = max(max|v|, eps) ;  scale[i] = a / fp8_max ;
    q[i, :] = clamp(v · (fp8_max / a)) → fp8

Per element that is one multiply by the row's reciprocal (computed once per row), not an IEEE division: the
division is about ten instructions per element on the GPU, as many as the rest of the kernel, which averaged
~2.3 TB/s on an H200 in the 8B step (half the memory's bandwidth: not bound by memory). Both per-row divisions
are IEEE (``div_rn``; Triton's ``/`` on float32 is approximate), so q and scale equal the torch path's
(:func:`lorafusion.ops.fp8_linear.quantize_rows_torch`) bit for bit. ``divide=True`` (benchmarks only)
launches the former per-element division instead.

One program per row (4 rows for 2k-4k-column rows without a column scale: ``SHORT_ROWS``). A row of up to
``MAX_SINGLE`` elements is held in registers: one read of x. Longer rows take two loops (max|v|, then q),
reading the row twice (the second time mostly from L2): on an H100 that was faster for 14k- and 28k-column
rows than one 16k/32k-wide block (0.61 vs 0.93 ms for fc1's dY at 12,288 rows), slower for 4k-column ones.

Transpose: [M, N] → [N, M] of one-byte elements (FP8, moved as they are) in 64×64 tiles (``W_q`` → ``W_qᵀ``,
the K-major operand of the input-gradient GEMM); ``Tensor.t().contiguous()`` on FP8 ran at ~0.2 TB/s on an
H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafusion.kernels.launch import Launcher


# MAX_SINGLE: the longest row quantized from registers (one read); measured on an H100
# (docs/results/fp8-probe-h100.json, "quant")
MAX_SINGLE = 8192
# two-loop rows of LONG_ROWS_FROM columns or more (fc1's dY, 28,672): 4k blocks and 16 warps, 0.872 ms against
# 1.292 with 8k blocks / 16 warps and 1.272 with 4k / 8 at 32,768 rows on an H200 (scripts/bench_fp8_quant.py,
# docs/results/fp8-quant-h200.json; on an H100 8k / 16 had beaten 4k / 8 at 12,288 rows); rows of 8k-16k
# columns (fc2's X) keep 4k / 8 (0.389 ms; the best other launch 0.381)
LONG_ROWS_FROM, LONG_ROWS = 16384, (4096, 16)
# rows of 4k-8k columns with a column scale (qkv's dY, 6,144): two loops of 2k blocks, 8 warps, 0.206 ms
# against 0.232 from registers at 32,768 rows on an H200
MID_CS_FROM, MID_CS_LOOPS = 4097, (2048, 8)
ROWS_PER_PROGRAM = 1  # rows a program quantizes when they fit MAX_SINGLE (quant_variants_ms in check_fp8.py)
# rows of 2k-4k columns without a column scale (X of qkv, proj and fc1 on the 8B: 4096): 4 rows a program and
# 16 warps, 0.070 ms against 0.088 (one row, 8 warps) at 12,288 rows on an H100, same bits (quant_variants_ms,
# 2026-11-25); with a column scale (dY of proj and fc2: 4096) 2 rows and 8 warps, 0.136 ms against 0.168 (one
# row, 8 warps) and 0.140 (4 rows, 16 warps) at 32,768 rows on an H200
SHORT_ROWS_FROM, SHORT_ROWS_UP_TO, SHORT_ROWS, SHORT_CS_ROWS = 2049, 4096, (4, 16), (2, 8)
_QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _load_scaled(x_row, cs_ptr, cols, mask, HAS_CS: tl.constexpr):
    """x[i, cols] in float32, times col_scale[cols] when given (0 outside ``mask``)."""
    v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_CS:
        v = v * tl.load(cs_ptr + cols, mask=mask, other=0.0)
    return v


@triton.jit
def _row_factors(amax, QMAX: tl.constexpr, EPS: tl.constexpr):
    """(scale, reciprocal) of rows whose max|v| is ``amax``: a / QMAX and QMAX / a, a = max(amax, EPS), both
    IEEE-rounded."""
    a = tl.maximum(amax, EPS)
    qmax = tl.full(a.shape, QMAX, tl.float32)
    return tl.math.div_rn(a, qmax), tl.math.div_rn(qmax, a)


@triton.jit
def _to_fp8(v, scale, inv, QMAX: tl.constexpr, DIVIDE: tl.constexpr):
    """clamp(v · inv) (``DIVIDE``: v / scale, the former per-element division) to ±QMAX, in float32."""
    if DIVIDE:
        q = tl.math.div_rn(v, scale)
    else:
        q = v * inv
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)


@triton.jit
def _quant_rows_kernel(x_ptr, cs_ptr, q_ptr, s_ptr, M, N, stride_x,
                       QMAX: tl.constexpr, EPS: tl.constexpr, HAS_CS: tl.constexpr, BLOCK: tl.constexpr,
                       SINGLE: tl.constexpr, ROWS: tl.constexpr, DIVIDE: tl.constexpr):
    if ROWS > 1:  # ROWS whole rows per program, in registers: one read (short rows: fewer, fuller programs)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        v = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_CS:
            v = v * tl.load(cs_ptr + cols, mask=cols < N, other=0.0)[None, :]
        scale, inv = _row_factors(tl.max(tl.abs(v), axis=1), QMAX, EPS)
        tl.store(s_ptr + rows, scale, mask=rows < M)
        q = _to_fp8(v, scale[:, None], inv[:, None], QMAX, DIVIDE)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        return
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * N  # q is contiguous
    if SINGLE:  # the whole row in registers: one read
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        v = _load_scaled(x_row, cs_ptr, cols, mask, HAS_CS)
        scale, inv = _row_factors(tl.max(tl.abs(v), axis=0), QMAX, EPS)
        tl.store(s_ptr + row, scale)
        q = _to_fp8(v, scale, inv, QMAX, DIVIDE)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:  # two loops over the row: max|v|, then q
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_load_scaled(x_row, cs_ptr, cols, cols < N, HAS_CS)))
        scale, inv = _row_factors(tl.max(amax, axis=0), QMAX, EPS)
        tl.store(s_ptr + row, scale)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            q = _to_fp8(_load_scaled(x_row, cs_ptr, cols, mask, HAS_CS), scale, inv, QMAX, DIVIDE)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor, dtype: torch.dtype, col_scale: torch.Tensor | None = None,
                         eps: float = 1e-12, max_single: int = MAX_SINGLE, num_warps: int | None = None,
                         block: int | None = None, rows: int | None = None, divide: bool = False,
                         qmax: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [m, n] ``dtype``, scale [m, 1] float32) for a 2-D CUDA tensor ``x`` whose last dim is contiguous.
    For benchmarks and tests: ``num_warps`` / ``block`` / ``rows`` (rows per program, single-read rows only)
    override the launch; ``divide``: divide each element by the scale (the former kernel: same scales, q
    off by a rounding in rare elements); ``qmax``: the largest |q| (default: ``dtype``'s), with a float32
    ``dtype`` q holds the clamped values before the cast to FP8."""
    m, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, n, device=x.device, dtype=dtype)
    s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m == 0:
        return q, s
    has_cs = col_scale is not None
    if max_single == MAX_SINGLE and num_warps is None and block is None and rows is None:
        key = (n, has_cs)
        choice = _LAUNCH.get(key) or _LAUNCH.setdefault(key, launch(n, has_cs))
    else:
        choice = launch(n, has_cs, max_single, num_warps, block, rows)
    single, block, rows, warps = choice
    _QUANT.launch((triton.cdiv(m, rows),), x, col_scale if has_cs else s, q, s, m, n, x.stride(0),
                  QMAX=qmax or _QMAX[dtype], EPS=eps, HAS_CS=has_cs, BLOCK=block, SINGLE=single, ROWS=rows,
                  DIVIDE=divide, num_warps=warps)
    return q, s


_LAUNCH: dict = {}  # (columns, column scale?) -> the default launch


def launch(n: int, has_col_scale: bool, max_single: int = MAX_SINGLE, num_warps: int | None = None,
           block: int | None = None, rows: int | None = None) -> tuple[bool, int, int, int]:
    """(one read?, BLOCK, rows a program, warps) of the row kernel for rows of ``n`` columns; a given
    ``num_warps`` / ``block`` / ``rows`` overrides the choice."""
    single = n <= max_single
    if (single and has_col_scale and n >= MID_CS_FROM and max_single == MAX_SINGLE
            and num_warps is None and block is None and rows is None):
        return False, MID_CS_LOOPS[0], 1, MID_CS_LOOPS[1]
    if not single:
        long_block, long_warps = LONG_ROWS if n >= LONG_ROWS_FROM else (4096, 8)
        return False, block or long_block, 1, num_warps or long_warps
    if rows is None and SHORT_ROWS_FROM <= n <= SHORT_ROWS_UP_TO:
        rows, short_warps = SHORT_CS_ROWS if has_col_scale else SHORT_ROWS
        num_warps = num_warps or short_warps
    block = block or triton.next_power_of_2(n)
    rows = rows or ROWS_PER_PROGRAM
    return True, block, rows, num_warps or _warps(block * rows)


def _warps(elements: int) -> int:
    return 16 if elements >= 16384 else 8 if elements >= 2048 else 4


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, M, N, stride_s, stride_d, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(src_ptr + rm[:, None].to(tl.int64) * stride_s + rn[None, :], mask=mask)
    tl.store(dst_ptr + rn[:, None].to(tl.int64) * stride_d + rm[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_triton(w: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``w.t().contiguous()`` for a 2-D CUDA tensor of one-byte elements (FP8) with a contiguous last dim."""
    m, n = w.shape
    dst = torch.empty(n, m, device=w.device, dtype=w.dtype)
    _transpose(w, dst, m, n, block)
    return dst


def transposed_operand(src: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``src`` (a one-byte [M, N] CUDA tensor, FP8, with a contiguous last dim) copied into column-major
    layout: [M, N] with strides (1, M), the data of ``srcᵀ`` row-major — the K-major operand of a GEMM by
    ``src`` (the input gradient's ``dY·W_q``). One allocation and one launch: the kernel moves FP8 elements
    as they are (loaded and stored as the same type, no conversion)."""
    m, n = src.shape
    dst = torch.empty_strided((m, n), (1, m), device=src.device, dtype=src.dtype)
    _transpose(src, dst, m, n, block)
    return dst


def _transpose(src: torch.Tensor, dst: torch.Tensor, m: int, n: int, block: int) -> None:
    """dst's data ([N, M] row-major, row stride M) = srcᵀ."""
    if m and n:
        grid = (triton.cdiv(m, block), triton.cdiv(n, block))
        _TRANSPOSE.launch(grid, src, dst, m, n, src.stride(0), m, BM=block, BN=block, num_warps=4)


# launched through the fast path (lorafusion.kernels.launch): a known specialization skips JITFunction.run
_QUANT, _TRANSPOSE = Launcher(_quant_rows_kernel), Launcher(_transpose_kernel)
