"""Plain-torch multi-adapter LoRA: the ground truth and the CPU path, and the fast torch path on CUDA.

For rows of adapter slot ``a`` (see :class:`~lorafusion.core.routing.Routing`)::

    S = (D_a ⊙ X)·A_aᵀ / (1-p_a)          (m×r_a; D_a regenerated from (seed_a, row id, column))
    Δ = s_a · S·B_aᵀ

:func:`multi_lora_delta_reference` (the ground truth, the CPU path): autograd of these torch ops gives the
backward. :func:`multi_lora_delta_torch` (``kernels: reference`` on CUDA, the "fused kernels off"
ablation): the same function with the kernels' graph split — X and S saved, the mask regenerated in
backward by one compiled elementwise kernel instead of stored — in plain torch ops. S is packed as
[m, r_max] (zero beyond r_a) so that one collective serves every adapter under tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import functools

from lorafusion.core.routing import Routing
from lorafusion.ops.tables import TableCache
from lorafusion.ops.comm import apply_s_comm
from lorafusion.ops.dropout import keep_mask


def row_ids(routing: Routing, device, cache=None) -> torch.Tensor:
    """The routing's dropout row ids as an int64 tensor on ``device`` (kept in ``cache`` when given)."""
    return (cache if cache is not None else TableCache()).row_ids(routing, device)


def dropout_rows(x: torch.Tensor, seed: int, row_ids: torch.Tensor, p: float, k_offset: int = 0,
                 k_total: int | None = None) -> torch.Tensor:
    """Inverted dropout of ``x`` [rows, k] with the counter-based mask; identity when p == 0."""
    if p == 0.0:
        return x
    keep = keep_mask(seed, row_ids, x.shape[-1], p, k_offset, k_total)
    return x * keep.to(x.dtype) / (1.0 - p)


def lora_shrink_reference(x2d: torch.Tensor, lora_A: Sequence[torch.Tensor], dropout_p: Sequence[float],
                          seeds: Sequence[int], routing: Routing, k_offset: int = 0,
                          k_total: int | None = None) -> torch.Tensor:
    """S = dropout(X)·Aᵀ per segment, packed to [m, r_max]."""
    m = x2d.shape[0]
    r_max = max(a.shape[0] for a in lora_A)
    ids = row_ids(routing, x2d.device)
    pieces, pos = [], 0
    for slot, start, length in routing.segments:
        if start > pos:
            pieces.append(x2d.new_zeros(start - pos, r_max))
        xs = dropout_rows(x2d[start:start + length], seeds[slot], ids[start:start + length],
                          float(dropout_p[slot]), k_offset, k_total)
        s = xs @ lora_A[slot].to(x2d.dtype).t()
        if s.shape[1] < r_max:
            s = torch.nn.functional.pad(s, (0, r_max - s.shape[1]))
        pieces.append(s)
        pos = start + length
    if pos < m:
        pieces.append(x2d.new_zeros(m - pos, r_max))
    return torch.cat(pieces, dim=0)


def lora_expand_reference(S: torch.Tensor, lora_B: Sequence[torch.Tensor], scaling: Sequence[float],
                          routing: Routing) -> torch.Tensor:
    """Δ = s·S[:, :r]·Bᵀ per segment; rows outside every segment are zero."""
    m = S.shape[0]
    n = lora_B[0].shape[0]
    pieces, pos = [], 0
    for slot, start, length in routing.segments:
        if start > pos:
            pieces.append(S.new_zeros(start - pos, n))
        b = lora_B[slot].to(S.dtype)
        pieces.append((S[start:start + length, : b.shape[1]] @ b.t()) * float(scaling[slot]))
        pos = start + length
    if pos < m:
        pieces.append(S.new_zeros(m - pos, n))
    return torch.cat(pieces, dim=0)


def multi_lora_delta_reference(x: torch.Tensor, lora_A: Sequence[torch.Tensor],
                               lora_B: Sequence[torch.Tensor],
                               scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                               routing: Routing, *, k_offset: int = 0, k_total: int | None = None,
                               s_comm: str | None = None, tp_group=None, cache=None,
                               seed_table=None) -> torch.Tensor:
    """The LoRA term only (add it to the base output). ``x``: [..., k] → [..., n]. (``cache`` and
    ``seed_table`` are accepted for a common signature and not needed here.)"""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] != routing.num_rows:
        raise ValueError(f"routing covers {routing.num_rows} rows but the input has {x2d.shape[0]}")
    S = lora_shrink_reference(x2d, lora_A, dropout_p, seeds, routing, k_offset, k_total)
    S = apply_s_comm(S, s_comm, tp_group)
    delta = lora_expand_reference(S, lora_B, scaling, routing)
    return delta.reshape(*lead, delta.shape[-1])


# ------------------------------------------------------------------------------ fast torch path (CUDA)


def _dropout_scaled(x: torch.Tensor, seed: torch.Tensor, ids: torch.Tensor, p: float, k_offset: int,
                    k_total: int) -> torch.Tensor:
    """keep⊙x/(1-p) with the counter-based mask (``seed`` a 0-dim int64 tensor, so one compiled kernel
    serves every seed)."""
    keep = keep_mask(seed, ids, x.shape[-1], p, k_offset, k_total)
    return (x * keep.to(x.dtype)) * (1.0 / (1.0 - p))


@functools.cache
def _compiled_dropout():
    return torch.compile(_dropout_scaled, dynamic=True)


def _drop(x, seed, ids, p, k_offset, k_total):
    if p == 0.0:
        return x
    fn = _compiled_dropout() if x.is_cuda else _dropout_scaled  # one fused kernel on the GPU
    return fn(x, seed, ids, float(p), int(k_offset), int(k_total))


class _TorchShrink(torch.autograd.Function):
    """S = (D⊙X)·Aᵀ/(1-p) per segment, [m, r_max]; saves X and A only, the mask is regenerated."""

    @staticmethod
    def forward(ctx, x2d, call, *lora_A):
        routing, seeds, ps, ids, k_offset, k_total = call
        r_max = max(a.shape[0] for a in lora_A)
        S = x2d.new_zeros(x2d.shape[0], r_max)
        for slot, start, length in routing.segments:
            a = lora_A[slot].to(x2d.dtype)
            xs = _drop(x2d[start:start + length], seeds[slot], ids[start:start + length], ps[slot], k_offset,
                       k_total)
            S[start:start + length, : a.shape[0]] = xs @ a.t()
        ctx.call = call
        ctx.save_for_backward(x2d, *lora_A)
        return S

    @staticmethod
    def backward(ctx, dS):
        routing, seeds, ps, ids, k_offset, k_total = ctx.call
        x2d, *lora_A = ctx.saved_tensors
        dS = dS.to(x2d.dtype)
        need_x = ctx.needs_input_grad[0]
        dx = _empty_but_gaps(x2d.shape, x2d, routing) if need_x else None  # segment rows written below
        dA = [None] * len(lora_A)
        for slot, start, length in routing.segments:
            a = lora_A[slot]
            r = a.shape[0]
            ds = dS[start:start + length, :r]
            sl = slice(start, start + length)
            if ctx.needs_input_grad[2 + slot]:
                xs = _drop(x2d[sl], seeds[slot], ids[sl], ps[slot], k_offset, k_total)
                g = (ds.t() @ xs).to(a.dtype)
                dA[slot] = g if dA[slot] is None else dA[slot] + g
            if need_x:
                dx[sl] = _drop(ds @ a.to(x2d.dtype), seeds[slot], ids[sl], ps[slot], k_offset, k_total)
        return (dx, None, *dA)


def _empty_but_gaps(shape, like: torch.Tensor, routing: Routing) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` (``like``'s dtype and device) whose rows outside every segment of
    ``routing`` are zero: the caller writes each segment's rows (one pass over the output fewer than
    zeros)."""
    out = like.new_empty(shape)
    pos = 0
    for _, start, length in routing.segments:
        if start > pos:
            out[pos:start].zero_()
        pos = start + length
    if pos < shape[0]:
        out[pos:].zero_()
    return out


class _TorchExpand(torch.autograd.Function):
    """Δ = s_a·S[:, :r_a]·B_aᵀ per segment, written into one [m, n] output: each segment's rows by its own
    matmul (``out=`` a row range), the scaling folded into B (an [n, r] copy, not a pass over [m, n]), only
    rows outside every segment zeroed — no per-segment pieces, no concatenation, no scaling pass over the
    output in forward or backward. Saves S and the scaled B's."""

    @staticmethod
    def forward(ctx, S, routing, scaling, *lora_B):
        m, n = S.shape[0], lora_B[0].shape[0]
        bs = [(b * float(sc)).to(S.dtype)
              for b, sc in zip(lora_B, scaling, strict=True)]  # one rounding, as b.to()
        out = _empty_but_gaps((m, n), S, routing)
        for slot, start, length in routing.segments:
            torch.mm(S[start:start + length, : bs[slot].shape[1]], bs[slot].t(),
                     out=out[start:start + length])
        ctx.routing = routing
        ctx.scaling, ctx.b_dtypes = [float(sc) for sc in scaling], [b.dtype for b in lora_B]
        ctx.save_for_backward(S, *bs)
        return out

    @staticmethod
    def backward(ctx, dout):
        S, *bs = ctx.saved_tensors
        dout = dout.to(S.dtype)
        need_s = ctx.needs_input_grad[0]
        dS = torch.zeros_like(S) if need_s else None
        dB: list[torch.Tensor | None] = [None] * len(bs)
        for slot, start, length in ctx.routing.segments:
            b, sl = bs[slot], slice(start, start + length)
            r = b.shape[1]
            if need_s:
                dS[sl, :r] = dout[sl] @ b
            if ctx.needs_input_grad[3 + slot]:
                g = (dout[sl].t() @ S[sl, :r]).float() * ctx.scaling[slot]
                dB[slot] = g if dB[slot] is None else dB[slot] + g
        return (dS, None, None,
                *(g if g is None else g.to(dt) for g, dt in zip(dB, ctx.b_dtypes, strict=True)))


def lora_expand_torch(S: torch.Tensor, lora_B: Sequence[torch.Tensor], scaling: Sequence[float],
                      routing: Routing) -> torch.Tensor:
    """:func:`lora_expand_reference` as one autograd op (see :class:`_TorchExpand`)."""
    return _TorchExpand.apply(S, routing, list(scaling), *lora_B)


def multi_lora_delta_torch(x: torch.Tensor, lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                           scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                           routing: Routing, *, k_offset: int = 0, k_total: int | None = None,
                           s_comm: str | None = None, tp_group=None, cache=None,
                           seed_table: torch.Tensor | None = None) -> torch.Tensor:
    """Same function as :func:`multi_lora_delta_reference`, built for speed and memory on a GPU (see the
    module doc). ``seed_table``: ``seeds`` as a device int64 tensor (built here when not given)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] != routing.num_rows:
        raise ValueError(f"routing covers {routing.num_rows} rows but the input has {x2d.shape[0]}")
    if seed_table is None:
        seed_table = torch.tensor([int(s) for s in seeds], dtype=torch.int64).to(x.device, non_blocking=True)
    ids = row_ids(routing, x2d.device, cache)
    k_total = x2d.shape[1] if k_total is None else int(k_total)
    call = (routing, seed_table, [float(p) for p in dropout_p], ids, int(k_offset), k_total)
    S = _TorchShrink.apply(x2d, call, *lora_A)
    S = apply_s_comm(S, s_comm, tp_group)
    delta = lora_expand_torch(S, lora_B, scaling, routing)
    return delta.reshape(*lead, delta.shape[-1])
