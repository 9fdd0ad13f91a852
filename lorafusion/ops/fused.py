"""Autograd Functions over the Triton FusedLoRA / FusedMultiLoRA kernels (``impl="triton"``).

Same contracts as :mod:`lorafusion.ops.reference` (see :func:`lorafusion.ops.multi_lora_delta`):

- :func:`multi_lora_linear_fused`: ``Y = X·Wᵀ (+bias) + Σ_seg s·S·Bᵀ``. Forward: the shrink kernel
  (S = drop(X)·Aᵀ/(1-p), mask regenerated from Philox, never stored), then the main GEMM. Backward: one pass
  over dY for dS and dB, the dX GEMM, and dA. Saved: X, S [m, r_max] and the per-call tables.
  The main GEMM (``main_gemm`` argument; default ``lorafusion.kernels.tuning.default_main_gemm()``):
  "cublas" (default; measured faster on Hopper) — the low-rank term is written by a Triton kernel and cuBLAS
  adds X·Wᵀ to it; in backward cuBLAS computes dY·W and one Triton pass adds keep⊙(dS·A)/(1-p) and produces
  dA with the same mask. "cublas_fold" — the same forward; in backward the Triton pass writes the low-rank
  dX term (and dA) first and cuBLAS adds dY·W into it (beta = 1, as the forward does), so dX is not read
  back by a memory-bound pass. "triton" — one Triton GEMM with the low-rank term as its initial accumulator
  (forward and dX), dA in its own pass.
- :func:`multi_lora_delta_fused`: the LoRA term alone, as shrink → tensor-parallel collective on S → expand,
  so "row" (all-reduce S in forward) and "column" (all-reduce dS in backward) compose as in the reference.
- :func:`fused_lora_linear` / :func:`fused_lora_delta`: single-adapter FusedLoRA (one segment, all rows).

Gradients are deterministic: reductions over rows go through per-chunk partials summed in a fixed order
(no atomics). ``weight`` is frozen in LoRA; if it requires grad, dW is computed with a plain matmul.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.core.routing import Routing
from lorafusion.kernels import fused_multi_lora as K
from lorafusion.ops.tables import TableCache
from lorafusion.kernels import tuning
from lorafusion.ops.comm import apply_s_comm

__all__ = ["multi_lora_linear_fused", "multi_lora_delta_fused", "fused_lora_linear", "fused_lora_delta"]


class _Plan:
    """Everything about one call that is not a differentiable tensor.

    ``cache`` holds the microbatch's routing tables and the adapter set's tables across calls (the LoRA
    layers pass their model's); ``seed_table``, if given, is ``seeds`` already on the device."""

    def __init__(self, x2d, lora_A, lora_B, scaling, dropout_p, seeds, routing, k_offset=0, k_total=None,
                 cache: TableCache | None = None, seed_table=None, main_gemm: str | None = None):
        if not (len(lora_A) == len(lora_B) == len(scaling) == len(dropout_p) == len(seeds)):
            raise ValueError("lora_A, lora_B, scaling, dropout_p and seeds need one entry per adapter slot")
        if x2d.shape[0] != routing.num_rows:
            raise ValueError(f"routing covers {routing.num_rows} rows but the input has {x2d.shape[0]}")
        for slot, _, _ in routing.segments:
            if slot >= len(lora_A):
                raise ValueError(f"routing names slot {slot} but only {len(lora_A)} adapters were given")
        self.routing = routing
        self.n_slots = len(lora_A)
        self.ranks = [a.shape[0] for a in lora_A]
        for a, b in zip(lora_A, lora_B, strict=True):
            if b.shape[1] != a.shape[0]:
                raise ValueError(f"lora_B {tuple(b.shape)} does not match lora_A {tuple(a.shape)} in rank")
        self.k = x2d.shape[1]
        self.n = lora_B[0].shape[0]
        self.k_offset = int(k_offset)
        self.k_total = self.k if k_total is None else int(k_total)
        self.main_gemm = main_gemm or tuning.default_main_gemm()
        if self.main_gemm not in tuning.MAIN_GEMMS:
            raise ValueError(f"main_gemm: expected one of {tuning.MAIN_GEMMS}, got {self.main_gemm!r}")
        self.cache = cache if cache is not None else TableCache()
        self.st = self.cache.slot_tables(self.ranks, scaling, dropout_p,
                                         seeds if seed_table is None else seed_table, x2d.device)
        self.row_ids = self.cache.row_ids(routing, x2d.device)


def _cat_A(lora_A, dtype):
    # concatenate, then cast once: two launches whatever the number of adapters (a cast per adapter, then the
    # concatenation, was one more launch per adapter; the cast is elementwise, so the result is the same)
    if len(lora_A) == 1:
        return lora_A[0].to(dtype)
    return torch.cat(list(lora_A), dim=0).to(dtype)


def _joined(parts) -> torch.Tensor | None:
    """The tensor whose consecutive column spans ``parts`` are, covering it (a fused linear's block B's made
    in one pass, :func:`lorafusion.layers.fused_proj.block_bs`): their concatenation as it is; else None."""
    base = parts[0]._base
    if base is None or len(parts) < 2 or base.dim() != 2:
        return None
    start = off = base.storage_offset()
    strides = base.stride()
    for p in parts:
        if p._base is not base or p.stride() != strides or p.shape[0] != base.shape[0] or \
                p.storage_offset() != off:
            return None
        off += p.shape[1] * strides[1]
    return base if off == start + base.shape[1] * strides[1] else None


def _B_cat(lora_B) -> torch.Tensor:
    """The B's side by side, [n, R_tot], in their dtype: a single B or the block B's of one pass
    (:func:`_joined`) as they are, else one concatenation."""
    b = lora_B[0] if len(lora_B) == 1 else _joined(lora_B)
    return torch.cat(list(lora_B), dim=1) if b is None else b


def _cat_Bt(lora_B, dtype):
    """The B's concatenated and transposed, [R_tot, n] contiguous in ``dtype`` (coalesced loads of the
    low-rank operand): one cast that also lays it out, not a cast and then a copy; ``Bt.t()`` is B_cat."""
    return _B_cat(lora_B).t().to(dtype, memory_format=torch.contiguous_format)


def _grads(parts, dtypes):
    """The adapters' gradients in their parameters' dtypes (``dtypes``: kept at forward — the parameters
    themselves are not saved: backward reads none of their values — or the parameters)."""
    out = []
    for g, d in zip(parts, dtypes, strict=True):
        d = getattr(d, "dtype", d)
        out.append(g if g is None or g.dtype == d else g.to(d))
    return tuple(out)


class _FusedMultiLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, plan: _Plan, *params):
        ns = plan.n_slots
        lora_A, lora_B = params[:ns], params[ns:]
        st = plan.st
        A_cat, Bt = _cat_A(lora_A, x2d.dtype), _cat_Bt(lora_B, x2d.dtype)
        S = K.lora_shrink(x2d, A_cat, st, plan.routing, plan.row_ids, k_total=plan.k_total, cache=plan.cache)
        w = weight if weight.dtype == x2d.dtype else weight.to(x2d.dtype)
        if plan.main_gemm != "triton":
            y = K.lora_gemm(None, None, bias, S, Bt, st.scale, st, plan.routing, n=plan.n, cache=plan.cache)
            # in place: out-of-place addmm first copies the low-rank term into a new tensor
            y.addmm_(x2d, w.t())
        else:
            y = K.lora_gemm(x2d, w.t(), bias, S, Bt, st.scale, st, plan.routing, n=plan.n, cache=plan.cache)
        ctx.plan = plan
        ctx.has_bias = bias is not None
        ctx.dtypes = [p.dtype for p in params]
        ctx.save_for_backward(x2d, weight, S, A_cat, Bt)
        return y

    @staticmethod
    def backward(ctx, dy):
        plan: _Plan = ctx.plan
        st = plan.st
        x2d, weight, S, A_cat, Bt = ctx.saved_tensors
        dtypes = ctx.dtypes
        ns = plan.n_slots
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_db = any(ctx.needs_input_grad[4 + ns:])
        need_da = any(ctx.needs_input_grad[4:4 + ns])
        if dy.dtype != x2d.dtype:
            dy = dy.to(x2d.dtype)
        dS, dB = K.lora_ds_db(dy, None, S, st, plan.routing, need_db=need_db, cache=plan.cache, Bt=Bt)
        dx = None
        dA = [None] * ns
        w = weight if weight.dtype == x2d.dtype else weight.to(x2d.dtype)
        if need_x and plan.main_gemm == "cublas_fold":
            # the low-rank dX term (and dA, same mask) by one Triton pass, then cuBLAS adds dY·W into it
            dx, dA = K.lora_da_dx(x2d, dS, A_cat, None, st, plan.routing, plan.row_ids, k_total=plan.k_total,
                                  need_da=need_da, cache=plan.cache)
            dx.addmm_(dy, w)
        elif need_x and plan.main_gemm == "cublas":
            # dX = dY·W by cuBLAS, then one pass adds keep⊙(dS·A)/(1-p) and produces dA with the same mask
            dx = dy @ w
            dx, dA = K.lora_da_dx(x2d, dS, A_cat, dx, st, plan.routing, plan.row_ids, k_total=plan.k_total,
                                  need_da=need_da, cache=plan.cache)
        else:
            if need_x:
                dx = K.lora_gemm(dy, w, None, dS, A_cat, st.inv_keep, st, plan.routing, n=plan.k,
                                 dropout=st.dropout, row_ids=plan.row_ids, k_total=plan.k_total,
                                 cache=plan.cache)
            if need_da:
                dA = K.lora_da(x2d, dS, st, plan.routing, plan.row_ids, k_total=plan.k_total,
                               cache=plan.cache)
        dw = (dy.t() @ x2d).to(weight.dtype) if need_w else None
        dbias = dy.sum(0) if (need_b and ctx.has_bias) else None
        if not need_db:
            dB = [None] * ns
        return (dx, dw, dbias, None, *_grads(dA, dtypes[:ns]), *_grads(dB, dtypes[ns:]))


class _Shrink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, plan: _Plan, *lora_A):
        A_cat = _cat_A(lora_A, x2d.dtype)
        S = K.lora_shrink(x2d, A_cat, plan.st, plan.routing, plan.row_ids, k_total=plan.k_total,
                          k_offset=plan.k_offset, cache=plan.cache)
        ctx.plan = plan
        ctx.dtypes = [a.dtype for a in lora_A]
        ctx.save_for_backward(x2d, A_cat)
        return S

    @staticmethod
    def backward(ctx, dS):
        plan: _Plan = ctx.plan
        st = plan.st
        x2d, A_cat = ctx.saved_tensors
        if dS.dtype != x2d.dtype:
            dS = dS.to(x2d.dtype)
        need_da = any(ctx.needs_input_grad[2:])
        dx, dA = None, [None] * plan.n_slots
        if ctx.needs_input_grad[0]:  # dX and dA in one pass, one mask per tile
            dx, dA = K.lora_da_dx(x2d, dS, A_cat, None, st, plan.routing, plan.row_ids, k_total=plan.k_total,
                                  k_offset=plan.k_offset, need_da=need_da, cache=plan.cache)
        elif need_da:
            dA = K.lora_da(x2d, dS, st, plan.routing, plan.row_ids, k_total=plan.k_total,
                           k_offset=plan.k_offset, cache=plan.cache)
        return (dx, None, *_grads(dA, ctx.dtypes))


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, S, plan: _Plan, *lora_B):
        Bt = _cat_Bt(lora_B, S.dtype)
        out = K.lora_gemm(None, None, None, S, Bt, plan.st.scale, plan.st, plan.routing, n=plan.n,
                          cache=plan.cache)
        ctx.plan = plan
        ctx.dtypes = [b.dtype for b in lora_B]
        ctx.save_for_backward(S, Bt)
        return out

    @staticmethod
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        S, Bt = ctx.saved_tensors
        need_db = any(ctx.needs_input_grad[2:])
        dS, dB = K.lora_ds_db(dout if dout.dtype == S.dtype else dout.to(S.dtype), None, S, plan.st,
                              plan.routing, need_db=need_db, cache=plan.cache, Bt=Bt)
        if not need_db:
            dB = [None] * plan.n_slots
        return (dS, None, *_grads(dB, ctx.dtypes))


def multi_lora_delta_fused(x: torch.Tensor, lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                           scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                           routing: Routing, *, k_offset: int = 0, k_total: int | None = None,
                           s_comm: str | None = None, tp_group=None, cache: TableCache | None = None,
                           seed_table: torch.Tensor | None = None) -> torch.Tensor:
    """The LoRA term only (see :func:`lorafusion.ops.multi_lora_delta`)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    plan = _Plan(x2d, lora_A, lora_B, scaling, dropout_p, seeds, routing, k_offset, k_total, cache=cache,
                 seed_table=seed_table)
    S = _Shrink.apply(x2d, plan, *lora_A)
    S = apply_s_comm(S, s_comm, tp_group)
    out = _Expand.apply(S, plan, *lora_B)
    return out.reshape(*lead, out.shape[-1])


def multi_lora_linear_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                            scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                            routing: Routing, *, cache: TableCache | None = None,
                            seed_table: torch.Tensor | None = None,
                            main_gemm: str | None = None) -> torch.Tensor:
    """Frozen base plus LoRA, one GEMM (see :func:`lorafusion.ops.multi_lora_linear`)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if weight.shape[1] != x2d.shape[1] or lora_B[0].shape[0] != weight.shape[0]:
        raise ValueError(f"weight {tuple(weight.shape)} / lora_B {tuple(lora_B[0].shape)} do not fit x "
                         f"{tuple(x.shape)}")
    plan = _Plan(x2d, lora_A, lora_B, scaling, dropout_p, seeds, routing, cache=cache, seed_table=seed_table,
                 main_gemm=main_gemm)
    y = _FusedMultiLoRALinear.apply(x2d, weight, bias, plan, *lora_A, *lora_B)
    return y.reshape(*lead, y.shape[-1])


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                      lora_B: torch.Tensor, scaling: float, dropout_p: float, seed: int, *,
                      routing: Routing | None = None, cache: TableCache | None = None) -> torch.Tensor:
    """Single-adapter FusedLoRA: ``X·Wᵀ (+bias) + s·dropout(X)·Aᵀ·Bᵀ`` (all rows, row ids = row index).
    Pass the same ``routing`` (all rows, one slot) and ``cache`` to repeated calls on one batch to build the
    kernels' tables once, as the LoRA layers do per microbatch."""
    m = x.numel() // x.shape[-1]
    return multi_lora_linear_fused(x, weight, bias, [lora_A], [lora_B], [scaling], [dropout_p], [seed],
                                   routing or Routing.single(m), cache=cache)


def fused_lora_delta(x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                     dropout_p: float, seed: int) -> torch.Tensor:
    """Single-adapter LoRA term alone."""
    m = x.numel() // x.shape[-1]
    return multi_lora_delta_fused(x, [lora_A], [lora_B], [scaling], [dropout_p], [seed], Routing.single(m))
