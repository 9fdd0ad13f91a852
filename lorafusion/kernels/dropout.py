"""In-kernel dropout masks: the same function of (seed, row id, global column) as ``lorafusion.ops.dropout``.

``keep = tl.rand(seed, offset) >= p`` with the int32 offset ``row_id * k_total + k_offset + col`` (mod 2**32).
The row part ``row_id * k_total + k_offset`` is computed once per row (int64, then wrapped to int32) and the
column is added in wrapping int32 arithmetic, which equals the reference's ``mod 2**32``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offsets(row_ids, k_total, k_offset):
    """Per-row base counter ``(row_id * k_total + k_offset) mod 2**32`` as int32; ``row_ids`` int64 [BM]."""
    return (row_ids * k_total + k_offset).to(tl.uint32, bitcast=False).to(tl.int32, bitcast=True)


@triton.jit
def keep_tile(seed, row_base, cols, p):
    """Boolean keep mask [BM, BN]: ``row_base`` int32 [BM] from :func:`row_offsets`, ``cols`` [BN] global columns."""
    offs = row_base[:, None] + cols.to(tl.int32)[None, :]
    return tl.rand(seed, offs) >= p


@triton.jit
def _mask_kernel(out_ptr, rowid_ptr, seed, p, M, K, k_total, k_offset, BM: tl.constexpr, BK: tl.constexpr):
    """Test helper: writes the keep mask [M, K] (int8) for checking against the torch reference."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    rid = tl.load(rowid_ptr + offs_m, mask=offs_m < M, other=0)
    keep = keep_tile(seed, row_offsets(rid, k_total, k_offset), offs_k, p)
    tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], keep.to(tl.int8),
             mask=(offs_m[:, None] < M) & (offs_k[None, :] < K))


def keep_mask_triton(seed: int, row_ids, k: int, p: float, k_offset: int = 0, k_total: int | None = None):
    """The kernels' mask as a bool tensor [len(row_ids), k] (for tests and debugging)."""
    import torch

    k_total = k if k_total is None else k_total
    m = row_ids.numel()
    out = torch.empty(m, k, dtype=torch.int8, device=row_ids.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(k, 32))
    _mask_kernel[grid](out, row_ids.to(torch.int64).contiguous(), seed, p, m, k, k_total, k_offset, BM=16, BK=32)
    return out.bool()
