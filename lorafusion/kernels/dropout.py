"""In-kernel dropout masks: the same function of (seed, row id, global column) as ``lorafusion.ops.dropout``.

One Philox-4x32-10 call (``tl.randint4x``) gives four 32-bit words = eight 16-bit uniforms, so eight
consecutive columns share one counter:

    counter = (row_id * ceil(k_total / 8) + (k_offset + col) // 8) mod 2**32
    t = (k_offset + col) % 8 ;  u16 = (word[t // 2] >> (16 * (t % 2))) & 0xFFFF ;  keep = u16 >= thr
    thr = ceil(p * 65536)

That is 8x fewer Philox evaluations than one ``tl.rand`` per element (Philox is ~100 integer ops, which made
the mask, not memory, the cost of the X passes). Tiles whose first global column is a multiple of 8 (always,
when ``k_offset % 8 == 0``) build the mask from [BM, BN/8] counters and interleave the eight slices with
``tl.join``; otherwise every element evaluates its own counter (correct, slower).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_counter_base(row_ids, k_total):
    """Per-row counter base ``row_id * ceil(k_total/8) mod 2**32`` as int32 (``row_ids`` int64 [BM])."""
    return (row_ids * ((k_total + 7) // 8)).to(tl.int32)


@triton.jit
def keep_tile(seed, thr, row_base, col0, BN: tl.constexpr, ALIGNED: tl.constexpr):
    """Keep mask [BM, BN] for global columns ``col0 + arange(BN)``.

    ``seed`` (int64) and ``thr`` (int32) are scalars or [BM, 1] (one adapter per row); ``row_base`` from
    :func:`row_counter_base`. ``ALIGNED``: ``col0 % 8 == 0`` (and BN % 8 == 0).
    """
    thr_u = thr.to(tl.uint32)
    if ALIGNED:
        ctr = row_base[:, None] + (col0 // 8 + tl.arange(0, BN // 8))[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, ctr)
        lo = 0xFFFF
        # final[..., v, w1, w0] = slice 4v + 2w1 + w0 (tl.join adds the new axis last)
        u = tl.join(tl.join(tl.join(r0 & lo, r2 & lo), tl.join(r1 & lo, r3 & lo)),
                    tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16)))
        u = tl.reshape(u, (row_base.shape[0], BN))
        return u >= thr_u
    else:
        g = col0 + tl.arange(0, BN)
        ctr = row_base[:, None] + (g // 8)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, ctr)
        t = (g % 8)[None, :]
        w = tl.where(t < 2, r0, tl.where(t < 4, r1, tl.where(t < 6, r2, r3)))
        u = tl.where(t % 2 == 0, w & 0xFFFF, w >> 16)
        return u >= thr_u


@triton.jit
def _mask_kernel(out_ptr, rowid_ptr, seed, thr, M, K, k_total, k_offset,
                 BM: tl.constexpr, BK: tl.constexpr, ALIGNED: tl.constexpr):
    """Test helper: writes the keep mask [M, K] (int8) for checking against the torch reference."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    rid = tl.load(rowid_ptr + offs_m, mask=offs_m < M, other=0)
    keep = keep_tile(seed, thr, row_counter_base(rid, k_total), k_offset + pid_k * BK, BK, ALIGNED)
    tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], keep.to(tl.int8),
             mask=(offs_m[:, None] < M) & (offs_k[None, :] < K))


def keep_mask_triton(seed: int, row_ids, k: int, p: float, k_offset: int = 0, k_total: int | None = None):
    """The kernels' mask as a bool tensor [len(row_ids), k] (for tests and debugging)."""
    import torch

    from lorafusion.core.seeds import keep_threshold

    k_total = k if k_total is None else k_total
    m = row_ids.numel()
    out = torch.empty(m, k, dtype=torch.int8, device=row_ids.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(k, 32))
    _mask_kernel[grid](out, row_ids.to(torch.int64).contiguous(), seed, keep_threshold(p), m, k, k_total,
                       k_offset, BM=16, BK=32, ALIGNED=k_offset % 8 == 0)
    return out.bool()
