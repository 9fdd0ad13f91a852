"""FusedMultiLoRA launchers: shapes, block configs and grids around the kernels of :mod:`.fused_lora`.

Every launcher takes the call's :class:`~lorafusion.ops.tables.SlotTables` (``st``) and a
:class:`~lorafusion.ops.tables.TableCache` (``cache``) that holds the microbatch's routing tables (built on
the first call of a microbatch and reused by every layer; a fresh cache builds them for this call). Both come
from :mod:`lorafusion.ops` (host-side tables, no Triton), which calls these launchers: they are handed in, not
imported.
"""

from __future__ import annotations

import os

import torch
import triton

from lorafusion.kernels.fused_lora import (
    _da_dx_kernel,
    _da_kernel,
    _ds_db_kernel,
    _lora_gemm_kernel,
    _shrink_kernel,
)
from lorafusion.kernels.launch import Launcher
from lorafusion.kernels.tuning import get_config

# launched through the fast path (lorafusion.kernels.launch): a known specialization skips JITFunction.run
_GEMM, _SHRINK, _DS_DB, _DA, _DA_DX = (Launcher(k) for k in (_lora_gemm_kernel, _shrink_kernel, _ds_db_kernel,
                                                             _da_kernel, _da_dx_kernel))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: float32 follows PyTorch's float32 matmul
    precision ("highest", the default, = IEEE; "high"/"medium" = TF32); 16-bit types are unaffected."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


_CONFIGS: dict = {}


def _config(kind: str, m: int, n: int, k: int, itemsize: int, rb: int) -> dict:
    """:func:`launch_config`, memoized (the environment get_config reads is part of the key). Read-only."""
    key = (kind, m, n, k, itemsize, rb, os.environ.get("TRITON_INTERPRET"),
           os.environ.get("LORAFUSION_TUNING_FILE"))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) >= 4096:
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = launch_config(kind, m, n, k, itemsize, rb)
    return cfg


def launch_config(kind: str, m: int, n: int, k: int, itemsize: int, rb: int) -> dict:
    """The launch config of ``kind`` at this shape: :func:`get_config` with the launchers' clamps for the
    rank block ``rb``."""
    cfg = get_config(kind, m, n, k, itemsize)
    if kind == "shrink":
        cfg["BM"] = max(16, min(cfg["BM"], 8192 // rb))
        cfg["BK"] = max(16, min(cfg["BK"], 16384 // rb))
    elif kind == "ds_db":
        # the [BN, RB] fp32 accumulator in registers, the [BM|BN, RB] operand tiles in shared memory
        cap = max(16, 32768 // (rb * itemsize))
        cfg["BN"] = max(16, min(cfg["BN"], 16384 // rb, cap))
        cfg["BM"] = max(16, min(cfg["BM"], cap))
        # dS by its own pass from rank block 128 on: the fp32 dS partials per n-block (4·rb bytes a row per
        # BN columns) would outweigh the second read of dY (2·BN bytes)
        cfg.setdefault("SPLIT", int(rb >= 128))
    elif kind == "da":
        cfg["BK"] = max(16, min(cfg["BK"], 16384 // rb))  # the [RB, BK] fp32 accumulator in registers
    elif kind == "da_dx":
        cfg["BK"] = max(16, min(cfg["BK"], 8192 // rb))
        cfg.setdefault("PREFETCH", 0)  # dX and dS loaded one row block ahead: an option, not measured yet
    cfg.setdefault("BK", 16)
    return cfg


# ---------------------------------------------------------------------------------------------- launchers


def lora_gemm(x: torch.Tensor | None, w_kn: torch.Tensor | None, bias: torch.Tensor | None, S: torch.Tensor,
              L_rn: torch.Tensor, coef: torch.Tensor, st, routing, *, n: int, dropout: bool = False,
              row_ids: torch.Tensor | None = None, k_total: int = 0, k_offset: int = 0,
              out: torch.Tensor | None = None, out_dtype=None, accumulate: bool = False,
              cache) -> torch.Tensor:
    """``out[m, n] = x·w_kn (+bias) + Σ_seg coef[a]·keep⊙(S[:, :r_a]·L_rn[roff_a:roff_a+r_a, :])``.

    ``w_kn`` and ``L_rn`` are any strided views with shapes [K, n] and [R_tot, n]; ``x`` None → low-rank only.
    ``accumulate``: ``out`` (given) is added to, in place (``out +=`` the above, one read and one write of
    it).
    """
    if accumulate and out is None:
        raise ValueError("lora_gemm: accumulate needs out")
    m = S.shape[0]
    has_main = x is not None
    kdim = x.shape[1] if has_main else 0
    rk = min(st.rb, 64)  # the rank chunk of the low-rank dots: the low-rank term's bucket is (m, n, rk)
    cfg = _config("gemm" if has_main else "lowrank", m, n, kdim if has_main else rk, S.element_size(), st.rb)
    bm, bn = cfg["BM"], cfg["BN"]
    segs, mb = cache.gemm_tables(routing, bm, S.device)
    if out is None:
        out = torch.empty(m, n, device=S.device, dtype=out_dtype or S.dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    dummy = S
    _GEMM.launch(grid,
        x if has_main else dummy, w_kn if has_main else dummy, bias if bias is not None else dummy, S, L_rn,
        out, row_ids if dropout else dummy, segs, mb,
        st.seed, st.thr, coef, st.r, st.roff,
        m, n, kdim,
        x.stride(0) if has_main else 0, x.stride(1) if has_main else 0,
        w_kn.stride(0) if has_main else 0, w_kn.stride(1) if has_main else 0,
        S.stride(0), S.stride(1), L_rn.stride(0), L_rn.stride(1), out.stride(0), out.stride(1),
        k_total, k_offset,
        HAS_MAIN=has_main, HAS_BIAS=bias is not None, DROPOUT=bool(dropout), ALIGNED=k_offset % 8 == 0,
        BM=bm, BN=bn, BK=cfg["BK"], RK=rk, GROUP_M=cfg["GROUP_M"],
        PREC=dot_precision(S.dtype),
        ACCUM=accumulate, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def lora_shrink(x: torch.Tensor, A_cat: torch.Tensor, st, routing, row_ids: torch.Tensor | None, *,
                k_total: int, k_offset: int = 0, cache, coef: torch.Tensor | None = None,
                dropout: bool | None = None) -> torch.Tensor:
    """S [m, r_max] = keep⊙X·A_aᵀ/(1-p_a) per segment (zero beyond r_a and outside every segment), one launch
    per rank block. ``coef`` (per slot; default 1/(1-p)) and ``dropout`` (default: the slots') let the same
    pass compute dS = s·dY·B (X = dY, A = Bᵀ, coef = s, no mask)."""
    m, kdim = x.shape
    dropout = st.dropout if dropout is None else dropout
    coef = st.inv_keep if coef is None else coef
    S = torch.empty(m, st.r_max, device=x.device, dtype=x.dtype)
    for i, (rb, rmax, _) in enumerate(cache.classes(routing, st.ranks)):
        cfg = _config("shrink", m, rmax, kdim, x.element_size(), rb)
        _, _, chunks, n_chunks, _ = cache.class_chunks(routing, cfg["BM"], x.device, st.ranks)[i]
        _SHRINK.launch((n_chunks,),
            x, A_cat, S, row_ids if row_ids is not None else x, chunks, st.seed, st.thr, coef, st.r, st.roff,
            kdim, st.r_max, x.stride(0), x.stride(1), A_cat.stride(0), A_cat.stride(1), S.stride(0),
            S.stride(1), k_total, k_offset,
            DROPOUT=dropout, ALIGNED=k_offset % 8 == 0, BM=cfg["BM"],
            BK=cfg["BK"], RB=rb, PREC=dot_precision(x.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return S


def _reduce_by_slot(partial: torch.Tensor, ranges: dict, ranks, rb: int,
                    dim: int) -> list[torch.Tensor | None]:
    """Per slot: the sum of its contiguous range of partials (fixed order: deterministic), cut to the slot's
    rank along ``dim`` of the sum (no cut where the rank fills the block); None for a slot without rows.

    The chunk tables list the slots' ranges in slot order from the first chunk on, so one split gives every
    range (the same views as slicing each, so the same sums)."""
    out = [None] * len(ranks)
    if not ranges:
        return out
    slots = sorted(ranges)
    sizes, pos = [], 0
    for a in slots:
        lo, hi = ranges[a]
        if lo != pos:  # not back to back (not the chunk tables' layout): a slice per slot
            pieces = [partial[ranges[b][0]:ranges[b][1]] for b in slots]
            break
        sizes.append(hi - lo)
        pos = hi
    else:
        if pos < partial.shape[0]:
            sizes.append(partial.shape[0] - pos)
        pieces = partial.split(sizes) if len(sizes) > 1 else (partial,)
    for a, piece in zip(slots, pieces):
        part = piece.sum(0)
        r = ranks[a]
        out[a] = part if r == rb else part.narrow(dim, 0, r)
    return out


def _merge(parts: list[list]) -> list:
    """Per slot, the one non-None entry of the classes' lists (a slot is in one class)."""
    out = parts[0]
    for more in parts[1:]:
        out = [a if a is not None else b for a, b in zip(out, more)]
    return out


def lora_ds_db(dy: torch.Tensor, B_cat: torch.Tensor | None, S: torch.Tensor, st, routing,
               need_db: bool = True, *, cache, Bt: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """dS [m, r_max] (dtype of S) and dB per slot (fp32 [n, r_a], None if no rows). B is ``B_cat``
    [n, R_tot] or, given instead, ``Bt`` [R_tot, n] (any strides either way).

    Largest rank block under 128 and its config without ``SPLIT``: one pass over dY for both, every row at
    the largest block (dS summed from fp32 partials per n-block; measured on an H200 at the 8B's linears, a
    pass per block and dS on its own were slower there). Otherwise: dS = s·dY·B by the shrink pass, dB alone
    per rank block (at block 256 the fp32 dS partials were 8x the bytes of dY: 6.8 ms -> 0.85 ms on the
    q/k/v linear at 32,768 tokens, three r=16 and one r=64)."""
    m, n = dy.shape
    b = Bt if Bt is not None else B_cat.t()  # [R_tot, n] view
    classes = cache.classes(routing, st.ranks)
    cfgs = [_config("ds_db", m, n, rmax, dy.element_size(), rb) for rb, rmax, _ in classes]
    if cache.one_block or (st.rb < 128 and not cfgs[-1].get("SPLIT")):
        return _ds_db_one_pass(dy, b, S, st, routing, need_db,
                               _config("ds_db", m, n, st.r_max, dy.element_size(), st.rb), cache)
    dS = lora_shrink(dy, b, st, routing, None, k_total=n, cache=cache, coef=st.scale, dropout=False)
    dS = dS.to(S.dtype)
    if not need_db:
        return dS, []
    parts = []
    for i, ((rb, _, _), cfg) in enumerate(zip(classes, cfgs)):
        bn = cfg["BN"]
        _, _, chunks, n_chunks, ranges = cache.class_chunks(routing, cfg["CH"], dy.device, st.ranks,
                                                            by_slot=True)[i]
        dbp = torch.empty(n_chunks, n, rb, device=dy.device, dtype=torch.float32)
        _DS_DB.launch((triton.cdiv(n, bn), n_chunks),
            dy, b, S, dbp, dbp, chunks, st.scale, st.r, st.roff, m, n,
            dy.stride(0), dy.stride(1), b.stride(1), b.stride(0), S.stride(0), S.stride(1),
            BM=cfg["BM"], BN=bn, RB=rb, PREC=dot_precision(dy.dtype), NEED_DS=False,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        parts.append(_reduce_by_slot(dbp, ranges, st.ranks, rb, 1))
    return dS, _merge(parts)


def _ds_db_one_pass(dy, b, S, st, routing, need_db, cfg, cache):
    m, n = dy.shape
    bn = cfg["BN"]
    chunks, n_chunks, ranges = cache.chunk_table(routing, cfg["CH"], dy.device, by_slot=True)
    nblk = triton.cdiv(n, bn)
    dsp = torch.empty(nblk, m, st.rb, device=dy.device, dtype=torch.float32)
    dbp = torch.empty(n_chunks, n, st.rb, device=dy.device, dtype=torch.float32)
    _DS_DB.launch((nblk, n_chunks),
        dy, b, S, dsp, dbp, chunks, st.scale, st.r, st.roff, m, n,
        dy.stride(0), dy.stride(1), b.stride(1), b.stride(0), S.stride(0), S.stride(1),
        BM=cfg["BM"], BN=bn, RB=st.rb, PREC=dot_precision(dy.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    dS = dsp[0] if nblk == 1 else dsp.sum(0)
    if st.r_max < st.rb:
        dS = dS[:, : st.r_max]
    dS = dS.to(S.dtype)
    dB = _reduce_by_slot(dbp, ranges, st.ranks, st.rb, 1) if need_db else []
    return dS, dB


def _da_classes(kernel: str, x: torch.Tensor, routing, st, cache):
    """Per rank block of the call's adapters, for ``kernel`` ("da" or "da_dx"): (rank block, its config, the
    block's chunk table, chunk count, slot ranges, the fp32 dA partials [chunks, rank block, k] to fill)."""
    m, kdim = x.shape
    for i, (rb, rmax, _) in enumerate(cache.classes(routing, st.ranks)):
        cfg = _config(kernel, m, rmax, kdim, x.element_size(), rb)
        _, _, chunks, n_chunks, ranges = cache.class_chunks(routing, cfg["CH"], x.device, st.ranks,
                                                            by_slot=True)[i]
        yield rb, cfg, chunks, n_chunks, ranges, torch.empty(n_chunks, rb, kdim, device=x.device,
                                                             dtype=torch.float32)


def lora_da(x: torch.Tensor, dS: torch.Tensor, st, routing, row_ids: torch.Tensor, *,
            k_total: int, k_offset: int = 0, cache) -> list[torch.Tensor | None]:
    """dA per slot (fp32 [r_a, k], None if the slot has no rows) = dSᵀ·keep⊙X/(1-p), per rank block."""
    kdim = x.shape[1]
    parts = []
    for rb, cfg, chunks, n_chunks, ranges, dap in _da_classes("da", x, routing, st, cache):
        bk = cfg["BK"]
        _DA.launch((triton.cdiv(kdim, bk), n_chunks),
            x, dS, dap, row_ids, chunks, st.seed, st.thr, st.inv_keep, st.r, st.roff,
            kdim, x.stride(0), x.stride(1), dS.stride(0), dS.stride(1), k_total, k_offset,
            DROPOUT=st.dropout, ALIGNED=k_offset % 8 == 0, BM=cfg["BM"], BK=bk, RB=rb,
            PREC=dot_precision(x.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        parts.append(_reduce_by_slot(dap, ranges, st.ranks, rb, 0))
    return _merge(parts)


def lora_da_dx(x: torch.Tensor, dS: torch.Tensor, A_cat: torch.Tensor, dx: torch.Tensor | None, st,
               routing, row_ids: torch.Tensor, *, k_total: int, k_offset: int = 0,
               need_da: bool = True, cache) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """dA per slot and ``dx (+)= keep⊙(dS·A)/(1-p)`` in one pass with one mask per tile, per rank block.

    ``dx`` given: accumulated into in place (it holds dY·W); None: a new tensor with the low-rank term alone.
    """
    m, kdim = x.shape
    acc = dx is not None
    if dx is None:
        dx = torch.empty(m, kdim, device=x.device, dtype=x.dtype)
    parts = []
    for rb, cfg, chunks, n_chunks, ranges, dap in _da_classes("da_dx", x, routing, st, cache):
        bk = cfg["BK"]
        _DA_DX.launch((triton.cdiv(kdim, bk), n_chunks),
            x, dS, A_cat, dx, dap, row_ids, chunks, st.seed, st.thr, st.inv_keep, st.r, st.roff,
            kdim, x.stride(0), x.stride(1), dS.stride(0), dS.stride(1), A_cat.stride(0), A_cat.stride(1),
            dx.stride(0), dx.stride(1), k_total, k_offset,
            ACC=acc, DROPOUT=st.dropout, ALIGNED=k_offset % 8 == 0, BM=cfg["BM"], BK=bk, RB=rb,
            PREC=dot_precision(x.dtype), PREFETCH=bool(cfg["PREFETCH"]), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        parts.append(_reduce_by_slot(dap, ranges, st.ranks, rb, 0) if need_da else [None] * len(st.ranks))
    return dx, _merge(parts)
