"""Triton kernels of FusedLoRA / FusedMultiLoRA (DESIGN §3).

Every kernel is segment-aware: rows of the packed batch form contiguous segments, each owned by one
adapter slot with its own rank ``r``, scale ``s``, dropout ``p`` and Philox seed. The single-adapter
FusedLoRA is the case of one segment covering every row. Per-tile metadata comes from small int32
offset tables (built once per microbatch, see :mod:`lorafusion.kernels.fused_multi_lora`), never from
pointer tables, so the kernels also run under ``TRITON_INTERPRET=1``.

Adapter weights of all slots are concatenated along the rank: ``A_cat`` [R_tot, k], ``B_cat`` [n, R_tot];
slot ``a`` owns rank rows/columns ``roff[a] .. roff[a]+r[a]``. Loads are masked to ``r[a]`` inside a
power-of-two block ``RB`` >= 16, which pads any rank 1..256 for ``tl.dot`` without copying.

Every ``tl.dot`` takes ``PREC`` (constexpr): "ieee" for float32 operands while PyTorch's float32 matmul
precision is "highest" (its default: no TF32), else "tf32" (Triton's default; for 16-bit operands it changes
nothing), so a float32 model's LoRA terms are as exact as its base matmuls (see ``dot_precision``).

Kernels
- ``_lora_gemm_kernel``: ``C = X·W' (+bias) + Σ_seg coef_a · keep_a ⊙ (S_seg · L_a)``. Forward:
  ``Y = X·Wᵀ + s·S·Bᵀ`` (L = Bᵀ, no mask); backward: ``dX = dY·W + keep ⊙ (dS·A)/(1-p)`` (L = A, mask
  regenerated). The low-rank term is computed first and becomes the initial accumulator of the main K
  loop (one [BM, BN] accumulator, no second one kept live). Rows of a tile belong to at most one segment,
  so per-row seed/threshold/coef vectors let one mask and one scaling pass serve every segment.
  ``HAS_MAIN=False`` gives the low-rank term alone (the tensor-parallel path, the cuBLAS variant).
- ``_shrink_kernel``: ``S = (keep ⊙ X)·Aᵀ/(1-p)`` per chunk (a chunk is ≤ BM rows of one segment).

The row-chunk kernels (shrink, ds_db, da, da_dx) are launched once per rank block among the call's adapters
(``lorafusion.ops.tables.rank_classes``): in a batch of mixed ranks an r=16 adapter's chunks run at block 16,
not at the r=64 adapter's 64.
- ``_ds_db_kernel``: one pass over dY: ``dS = s·dY·B`` (partial per n-block) and ``dB = s·dYᵀ·S``
  (partial per chunk); partials are summed in a fixed order (deterministic, no atomics). For large rank
  blocks the fp32 dS partials outweigh dY itself: dB alone here, dS by the shrink kernel (``dY·B`` is
  ``X·Aᵀ`` with A = Bᵀ, no mask, scale s), which reads dY once more and writes dS once.
- ``_da_kernel``: ``dA = dSᵀ·(keep ⊙ X)/(1-p)`` (partial per chunk), the mask regenerated.
- ``_da_dx_kernel``: dA and ``dX (+)= keep⊙(dS·A)/(1-p)`` in one pass over (X, dX) with one mask per tile
  (after a cuBLAS dY·W, and for the tensor-parallel delta path).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lorafusion.kernels.dropout import keep_tile, row_counter_base


@triton.jit
def _slot_meta(slot, r_ptr, roff_ptr):
    """(slot clamped, rank, rank offset); slot < 0 marks rows with no adapter (rank 0)."""
    sc = tl.maximum(slot, 0)
    r = tl.where(slot >= 0, tl.load(r_ptr + sc), 0)
    roff = tl.load(roff_ptr + sc)
    return sc, r, roff


# Row counts change with every packed microbatch: not specialised (Triton would otherwise compile a new
# variant the first time a count is 1 or a multiple of 16 — mid-run, on the training's critical path).
@triton.jit(do_not_specialize=["M"])
def _lora_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, s_ptr, l_ptr, out_ptr, rowid_ptr,
    seg_ptr, mb_ptr,
    seed_ptr, thr_ptr, coef_ptr, r_ptr, roff_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wk, stride_wn,
    stride_sm, stride_sr, stride_lr, stride_ln, stride_om, stride_on,
    k_total, k_offset,
    HAS_MAIN: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RK: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, ACCUM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N

    # Low-rank term first: every segment that overlaps this row block (usually one).
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    seg_lo = tl.load(mb_ptr + 2 * pid_m)
    seg_hi = tl.load(mb_ptr + 2 * pid_m + 1)
    offs_r = tl.arange(0, RK)
    coef_row = tl.zeros((BM,), dtype=tl.float32)
    seed_row = tl.zeros((BM,), dtype=tl.int64)
    thr_row = tl.zeros((BM,), dtype=tl.int32)
    for si in range(seg_lo, seg_hi):
        slot = tl.load(seg_ptr + 3 * si)
        start = tl.load(seg_ptr + 3 * si + 1)
        end = tl.load(seg_ptr + 3 * si + 2)
        sc, r, roff = _slot_meta(slot, r_ptr, roff_ptr)
        rowm = (offs_m >= start) & (offs_m < end)
        for r0 in range(0, r, RK):
            rr = r0 + offs_r
            rmask = rr < r
            s_t = tl.load(s_ptr + offs_m[:, None] * stride_sm + rr[None, :] * stride_sr,
                          mask=rowm[:, None] & rmask[None, :], other=0.0)
            l_t = tl.load(l_ptr + (roff + rr)[:, None] * stride_lr + offs_n[None, :] * stride_ln,
                          mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(s_t, l_t, acc, input_precision=PREC)
        coef_row = tl.where(rowm, tl.load(coef_ptr + sc), coef_row)
        if DROPOUT:
            seed_row = tl.where(rowm, tl.load(seed_ptr + sc), seed_row)
            thr_row = tl.where(rowm, tl.load(thr_ptr + sc), thr_row)
    if DROPOUT:
        rid = tl.load(rowid_ptr + offs_m, mask=offs_m < M, other=0)
        keep = keep_tile(seed_row[:, None], thr_row[:, None], row_counter_base(rid, k_total),
                         k_offset + pid_n * BN, BN, ALIGNED)
        acc = tl.where(keep, acc, 0.0)
    acc = acc * coef_row[:, None]

    if HAS_MAIN:
        offs_k = tl.arange(0, BK)
        rm = offs_m % M
        rn = offs_n % N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
        for kk in range(0, tl.cdiv(K, BK)):
            kmask = offs_k < K - kk * BK
            a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            x_ptrs += BK * stride_xk
            w_ptrs += BK * stride_wk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=nmask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    omask = (offs_m[:, None] < M) & nmask[None, :]
    if ACCUM:  # out += the result (out holds e.g. the FP8 base GEMM's output)
        acc += tl.load(out_ptrs, mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, rowid_ptr, chunk_ptr,
    seed_ptr, thr_ptr, inv_ptr, r_ptr, roff_ptr,
    K, R_OUT,
    stride_xm, stride_xk, stride_ar, stride_ak, stride_sm, stride_sr,
    k_total, k_offset,
    DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr,
    PREC: tl.constexpr,
):
    c = tl.program_id(0)
    slot = tl.load(chunk_ptr + 3 * c)
    start = tl.load(chunk_ptr + 3 * c + 1)
    length = tl.load(chunk_ptr + 3 * c + 2)
    sc, r, roff = _slot_meta(slot, r_ptr, roff_ptr)
    lm = tl.arange(0, BM)
    offs_m = start + lm
    rowm = lm < length
    offs_r = tl.arange(0, RB)
    rmask = offs_r < r
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + (roff + offs_r)[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BM, RB), dtype=tl.float32)
    if DROPOUT:
        seed = tl.load(seed_ptr + sc)
        thr = tl.load(thr_ptr + sc)
        rid = tl.load(rowid_ptr + offs_m, mask=rowm, other=0)
        row_base = row_counter_base(rid, k_total)
    n_k = tl.where(r > 0, tl.cdiv(K, BK), 0)
    for kk in range(0, n_k):
        kmask = offs_k < K - kk * BK
        x = tl.load(x_ptrs, mask=rowm[:, None] & kmask[None, :], other=0.0)
        if DROPOUT:
            x = tl.where(keep_tile(seed, thr, row_base, k_offset + kk * BK, BK, ALIGNED), x, 0.0)
        a = tl.load(a_ptrs, mask=kmask[:, None] & rmask[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PREC)
        x_ptrs += BK * stride_xk
        a_ptrs += BK * stride_ak
    acc = acc * tl.load(inv_ptr + sc)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + offs_r[None, :] * stride_sr,
             acc.to(s_ptr.dtype.element_ty), mask=rowm[:, None] & (offs_r < R_OUT)[None, :])
    # columns past this launch's rank block (a batch of mixed ranks launches per block): zeros
    zero = tl.zeros((BM, RB), dtype=s_ptr.dtype.element_ty)
    for r0 in range(RB, R_OUT, RB):
        rr = r0 + offs_r
        tl.store(s_ptr + offs_m[:, None] * stride_sm + rr[None, :] * stride_sr, zero,
                 mask=rowm[:, None] & (rr < R_OUT)[None, :])


@triton.jit(do_not_specialize=["M"])
def _ds_db_kernel(
    dy_ptr, b_ptr, s_ptr, dsp_ptr, dbp_ptr, chunk_ptr,
    coef_ptr, r_ptr, roff_ptr,
    M, N,
    stride_dym, stride_dyn, stride_bn, stride_br, stride_sm, stride_sr,
    BM: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr, PREC: tl.constexpr, NEED_DS: tl.constexpr = True,
):
    """Grid (n-blocks, chunks). dsp: fp32 [n_blocks, M, RB]; dbp: fp32 [chunks, N, RB]. ``NEED_DS`` False:
    dB alone (dS comes from another pass)."""
    nb = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(chunk_ptr + 3 * c)
    start = tl.load(chunk_ptr + 3 * c + 1)
    length = tl.load(chunk_ptr + 3 * c + 2)
    sc, r, roff = _slot_meta(slot, r_ptr, roff_ptr)
    coef = tl.load(coef_ptr + sc)
    offs_n = nb * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_r = tl.arange(0, RB)
    rmask = offs_r < r
    b = tl.load(b_ptr + offs_n[:, None] * stride_bn + (roff + offs_r)[None, :] * stride_br,
                mask=nmask[:, None] & rmask[None, :], other=0.0)
    db = tl.zeros((BN, RB), dtype=tl.float32)
    lm = tl.arange(0, BM)
    for i in range(0, tl.cdiv(length, BM)):
        rows = start + i * BM + lm
        rowm = i * BM + lm < length
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                     mask=rowm[:, None] & nmask[None, :], other=0.0)
        s = tl.load(s_ptr + rows[:, None] * stride_sm + offs_r[None, :] * stride_sr,
                    mask=rowm[:, None] & rmask[None, :], other=0.0)
        if NEED_DS:
            ds = tl.dot(dy, b, input_precision=PREC) * coef
            tl.store(dsp_ptr + nb * M * RB + rows[:, None] * RB + offs_r[None, :], ds, mask=rowm[:, None])
        db = tl.dot(tl.trans(dy), s, db, input_precision=PREC)
    tl.store(dbp_ptr + c * N * RB + offs_n[:, None] * RB + offs_r[None, :], db * coef, mask=nmask[:, None])


@triton.jit
def _da_kernel(
    x_ptr, ds_ptr, dap_ptr, rowid_ptr, chunk_ptr,
    seed_ptr, thr_ptr, inv_ptr, r_ptr, roff_ptr,
    K,
    stride_xm, stride_xk, stride_dsm, stride_dsr,
    k_total, k_offset,
    DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid (k-blocks, chunks). dap: fp32 [chunks, RB, K]."""
    kb = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(chunk_ptr + 3 * c)
    start = tl.load(chunk_ptr + 3 * c + 1)
    length = tl.load(chunk_ptr + 3 * c + 2)
    sc, r, roff = _slot_meta(slot, r_ptr, roff_ptr)
    offs_k = kb * BK + tl.arange(0, BK)
    kmask = offs_k < K
    offs_r = tl.arange(0, RB)
    rmask = offs_r < r
    acc = tl.zeros((RB, BK), dtype=tl.float32)
    if DROPOUT:
        seed = tl.load(seed_ptr + sc)
        thr = tl.load(thr_ptr + sc)
    lm = tl.arange(0, BM)
    n_i = tl.where(r > 0, tl.cdiv(length, BM), 0)
    for i in range(0, n_i):
        rows = start + i * BM + lm
        rowm = i * BM + lm < length
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=rowm[:, None] & kmask[None, :], other=0.0)
        if DROPOUT:
            rid = tl.load(rowid_ptr + rows, mask=rowm, other=0)
            keep = keep_tile(seed, thr, row_counter_base(rid, k_total), k_offset + kb * BK, BK, ALIGNED)
            x = tl.where(keep, x, 0.0)
        ds = tl.load(ds_ptr + rows[:, None] * stride_dsm + offs_r[None, :] * stride_dsr,
                     mask=rowm[:, None] & rmask[None, :], other=0.0)
        acc = tl.dot(tl.trans(ds), x, acc, input_precision=PREC)
    acc = acc * tl.load(inv_ptr + sc)
    tl.store(dap_ptr + c * RB * K + offs_r[:, None] * K + offs_k[None, :], acc, mask=kmask[None, :])


@triton.jit
def _da_dx_kernel(
    x_ptr, ds_ptr, a_ptr, dx_ptr, dap_ptr, rowid_ptr, chunk_ptr,
    seed_ptr, thr_ptr, inv_ptr, r_ptr, roff_ptr,
    K,
    stride_xm, stride_xk, stride_dsm, stride_dsr, stride_ar, stride_ak, stride_dxm, stride_dxk,
    k_total, k_offset,
    ACC: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """One pass over (X, dX) tiles with one mask per tile: dA partial = dSᵀ·keep⊙X/(1-p) (fp32 [chunks, RB,
    K]) and dX (+)= keep⊙(dS·A)/(1-p). ``ACC``: add into dX (it holds dY·W from cuBLAS); else write dX.

    ``PREFETCH``: the dX and dS tiles of the next row block are loaded one iteration ahead (Triton's
    pipeliner stages only the loads that feed a dot, X here: the dX tile loaded where it is added waits out
    the memory latency every iteration). It costs registers (ptxas, sm_90a: 32x256 at 4 warps spills 488
    bytes instead of 8) and is not measured yet: a config option, off by default."""
    kb = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(chunk_ptr + 3 * c)
    start = tl.load(chunk_ptr + 3 * c + 1)
    length = tl.load(chunk_ptr + 3 * c + 2)
    sc, r, roff = _slot_meta(slot, r_ptr, roff_ptr)
    inv = tl.load(inv_ptr + sc)
    offs_k = kb * BK + tl.arange(0, BK)
    kmask = offs_k < K
    offs_r = tl.arange(0, RB)
    rmask = offs_r < r
    a = tl.load(a_ptr + (roff + offs_r)[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                mask=rmask[:, None] & kmask[None, :], other=0.0)
    acc = tl.zeros((RB, BK), dtype=tl.float32)
    if DROPOUT:
        seed = tl.load(seed_ptr + sc)
        thr = tl.load(thr_ptr + sc)
    lm = tl.arange(0, BM)
    if ACC:
        n_i = tl.where(r > 0, tl.cdiv(length, BM), 0)
    else:
        n_i = tl.cdiv(length, BM)
    if PREFETCH:
        ds_ptrs = ds_ptr + (start + lm)[:, None] * stride_dsm + offs_r[None, :] * stride_dsr
        dx_ptrs = dx_ptr + (start + lm)[:, None] * stride_dxm + offs_k[None, :] * stride_dxk
        m0 = lm < length  # the first row block's dS (and dX to add to)
        ds_next = tl.load(ds_ptrs, mask=m0[:, None] & rmask[None, :] & (n_i > 0), other=0.0)
        if ACC:
            dx_next = tl.load(dx_ptrs, mask=m0[:, None] & kmask[None, :] & (n_i > 0), other=0.0)
        for i in range(0, n_i):
            rows = start + i * BM + lm
            rowm = i * BM + lm < length
            m2 = rowm[:, None] & kmask[None, :]
            ds = ds_next
            if ACC:
                dx_old = dx_next
            rown = (i + 1) * BM + lm < length  # the next row block's (all False after the last)
            ds_next = tl.load(ds_ptrs + (i + 1) * BM * stride_dsm, mask=rown[:, None] & rmask[None, :],
                              other=0.0)
            if ACC:
                dx_next = tl.load(dx_ptrs + (i + 1) * BM * stride_dxm, mask=rown[:, None] & kmask[None, :],
                                  other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m2, other=0.0)
            t = tl.dot(ds, a, input_precision=PREC) * inv
            if DROPOUT:
                rid = tl.load(rowid_ptr + rows, mask=rowm, other=0)
                keep = keep_tile(seed, thr, row_counter_base(rid, k_total), k_offset + kb * BK, BK, ALIGNED)
                x = tl.where(keep, x, 0.0)
                t = tl.where(keep, t, 0.0)
            acc = tl.dot(tl.trans(ds), x, acc, input_precision=PREC)
            if ACC:
                t += dx_old.to(tl.float32)
            tl.store(dx_ptrs + i * BM * stride_dxm, t.to(dx_ptr.dtype.element_ty), mask=m2)
    else:
        for i in range(0, n_i):
            rows = start + i * BM + lm
            rowm = i * BM + lm < length
            m2 = rowm[:, None] & kmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m2, other=0.0)
            ds = tl.load(ds_ptr + rows[:, None] * stride_dsm + offs_r[None, :] * stride_dsr,
                         mask=rowm[:, None] & rmask[None, :], other=0.0)
            t = tl.dot(ds, a, input_precision=PREC) * inv
            if DROPOUT:
                rid = tl.load(rowid_ptr + rows, mask=rowm, other=0)
                keep = keep_tile(seed, thr, row_counter_base(rid, k_total), k_offset + kb * BK, BK, ALIGNED)
                x = tl.where(keep, x, 0.0)
                t = tl.where(keep, t, 0.0)
            acc = tl.dot(tl.trans(ds), x, acc, input_precision=PREC)
            dx_ptrs = dx_ptr + rows[:, None] * stride_dxm + offs_k[None, :] * stride_dxk
            if ACC:
                t += tl.load(dx_ptrs, mask=m2, other=0.0).to(tl.float32)
            tl.store(dx_ptrs, t.to(dx_ptr.dtype.element_ty), mask=m2)
    acc = acc * inv
    tl.store(dap_ptr + c * RB * K + offs_r[:, None] * K + offs_k[None, :], acc, mask=kmask[None, :])
