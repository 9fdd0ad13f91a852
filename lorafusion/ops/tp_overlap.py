"""Tensor-parallel linears whose collectives overlap their own GEMMs, on plain NCCL / gloo collectives
(``async_op=True``: the collective runs on NCCL's stream while the compute stream multiplies; no symmetric
memory, no NVLink multicast). For the frozen base W of a Megatron parallel linear (no dW: the base is frozen
in LoRA):

- Sequence parallel (Megatron's layout: rank q's sequence shard is rows [q·m, (q+1)·m) of the gathered
  tensor). The input splits into the ranks' shards, tp nano-batches of m rows:
  - all-gather then multiply (column forward; row backward's dY): the all-gather is issued, this rank's
    own shard — which needs nothing gathered — is multiplied while it runs, then the other ranks' shards;
  - multiply then reduce-scatter (row forward; column backward's dX): the other ranks' blocks are multiplied
    into the send buffer (its own block zero), the reduce-scatter runs while the own block is multiplied,
    and the two are added.
  One collective each, of Megatron's size; every GEMM writes its rows of the output in place (no copies).
  The column forward also hands back the gathered input (``keep_input``), so the LoRA term reuses it instead
  of gathering the same rows again.
- Without SP (all-reduce: column backward's dX, row forward's Y): the rows in ``nano`` contiguous
  nano-batches (:func:`nano_bounds`), the all-reduce of one in flight while the next one's GEMM runs.

Every op inside is row-wise (a GEMM), so no split changes a result; attention, the one op that mixes rows, is
never split. Outputs are in Megatron's layout, so nothing after the linear changes; numbers equal the unsplit
linear up to the GEMMs' summation order (and, for a reduce-scatter, the order of the ranks' sum).

``nano = 0``: the same linears with their collectives in line (one collective, one GEMM, nothing split) — the
LoRA layers' TP path without overlap, which keeps the one gathered input and the one collective per direction.

Another term that is partial over the ranks in the same way as the base's rides on the base's collectives
(the LoRA term: :mod:`lorafusion.ops.comm`): a row linear takes a full-sequence ``delta`` (this rank's partial
s·S·Bᵀ) that is added to its partial output before the one reduce-scatter / all-reduce, and whose gradient is
the whole dY (under SP the all-gathered dY the base's backward gathers anyway); a column linear's kept input
(``keep_input``; under SP the gathered one, else the input itself) takes a partial gradient (this rank's
keep⊙(dS·A)) that is added to dY·W before the one reduce-scatter / all-reduce of dX.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["OVERLAPPED", "column_linear_overlapped", "gather_rows", "nano_bounds", "row_linear_overlapped"]

OVERLAPPED = [0]  # how many overlapped linear forwards ran (nano >= 1; tests read it)


def nano_bounds(rows: int, n: int, multiple: int = 1) -> list[tuple[int, int]]:
    """``[0, rows)`` as at most ``n`` contiguous, non-empty, disjoint row ranges covering it in order, as
    equal as whole multiples of ``multiple`` rows allow (the last takes the remainder); fewer when ``rows`` is
    too short for ``n`` (one range, no split, below 2·``multiple`` rows). An empty input: no range."""
    if n < 1 or multiple < 1:
        raise ValueError(f"nano_bounds: n and multiple must be >= 1, got n={n}, multiple={multiple}")
    units = rows // multiple
    k = max(1, min(n, units))
    cuts = [round(i * units / k) * multiple for i in range(k)] + [rows]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _others(tp: int, r: int, m: int) -> list[tuple[int, int]]:
    """The row ranges of the other ranks' blocks (contiguous runs before and after rank r's)."""
    return [(a, b) for a, b in ((0, r * m), ((r + 1) * m, tp * m)) if b > a]


def gather_rows(local: torch.Tensor, group, tp: int, async_op: bool = False):
    """The ranks' ``local`` tensors stacked along dim 0 in rank order (Megatron's sequence-parallel layout):
    one all-gather, no Megatron group look-up. ``async_op``: (that tensor, the collective's work), issued and
    not waited for."""
    full = local.new_empty((tp * local.shape[0], *local.shape[1:]))
    work = dist.all_gather_into_tensor(full, local.contiguous(), group=group, async_op=async_op)
    return (full, work) if async_op else full


def _gather_mm(local: torch.Tensor, group, w: torch.Tensor, keep: bool, overlap: bool = True, then=None):
    """(``all_gather(local) @ w`` in Megatron's gathered layout — rank q's rows at [q·m, (q+1)·m) — and the
    gathered input, or None unless ``keep``): one all-gather in flight while this rank's own block, which
    needs nothing gathered, is multiplied; then the other ranks' blocks. Every GEMM writes its rows of the
    output in place (no copies). Without ``overlap``: the all-gather, then one GEMM. ``then()``: called once
    the all-gather is issued, before the GEMMs (a collective issued there runs under them, after this
    one)."""
    tp, r, (m, k) = _world(group), _rank(group), local.shape
    if not overlap:
        full = gather_rows(local, group, tp)
        if then is not None:
            then()
        return torch.matmul(full, w), (full if keep else None)
    local = local.contiguous()
    full = local.new_empty(tp * m, k)
    work = dist.all_gather_into_tensor(full, local, group=group, async_op=True)
    if then is not None:
        then()
    out = local.new_empty(tp * m, w.shape[-1])
    torch.matmul(local, w, out=out[r * m:(r + 1) * m])
    work.wait()
    for a, b in _others(tp, r, m):
        torch.matmul(full[a:b], w, out=out[a:b])
    return out, (full if keep else None)


def _mm(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None, out: torch.Tensor | None = None):
    """``x @ w (+ add)`` (into ``out`` when given)."""
    if add is None:
        return torch.matmul(x, w, out=out)
    return torch.addmm(add, x, w, out=out)


def _mm_scatter(full: torch.Tensor, group, w: torch.Tensor, overlap: bool = True,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """``reduce_scatter(full @ w + add)`` (``full`` in the gathered layout; this rank's m rows come back;
    ``add``: a partial term of the same shape as the product, in its dtype, or None): the other ranks' blocks
    first, into the send buffer whose own block is zero; the reduce-scatter in flight while the own block is
    multiplied; then the two added. Without ``overlap``: one GEMM, then the reduce-scatter."""
    tp, r = _world(group), _rank(group)
    m = full.shape[0] // tp
    if not overlap:
        buf = _mm(full, w, add)
        recv = buf.new_empty(m, w.shape[-1])
        dist.reduce_scatter_tensor(recv, buf, group=group)
        return recv
    buf = full.new_empty(tp * m, w.shape[-1])
    for a, b in _others(tp, r, m):
        _mm(full[a:b], w, None if add is None else add[a:b], out=buf[a:b])
    buf[r * m:(r + 1) * m].zero_()
    recv = buf.new_empty(m, w.shape[-1])
    work = dist.reduce_scatter_tensor(recv, buf, group=group, async_op=True)
    own = _mm(full[r * m:(r + 1) * m], w, None if add is None else add[r * m:(r + 1) * m])
    work.wait()
    return own.add_(recv)


def _mm_allreduce(x: torch.Tensor, group, w: torch.Tensor, nano: int,
                  add: torch.Tensor | None = None) -> torch.Tensor:
    """``all_reduce(x @ w + add)`` (``add`` as for :func:`_mm_scatter`) in nano-batches of rows: the
    all-reduce of one in flight while the next one's GEMM runs, each GEMM writing its rows of the output in
    place. ``nano = 0``: one GEMM, one all-reduce."""
    if nano < 1:
        out = _mm(x, w, add)
        dist.all_reduce(out, group=group)
        return out
    out = x.new_empty(x.shape[0], w.shape[-1])
    works = []
    for a, b in nano_bounds(x.shape[0], nano):
        _mm(x[a:b], w, None if add is None else add[a:b], out=out[a:b])
        works.append(dist.all_reduce(out[a:b], group=group, async_op=True))
    for work in works:
        work.wait()
    return out


def _reduce(part: torch.Tensor, group, sp: bool) -> torch.Tensor:
    """Σ_ranks ``part``: reduce-scattered to this rank's rows (``sp``), else all-reduced."""
    if not sp:
        out = part.clone()
        dist.all_reduce(out, group=group)
        return out
    recv = part.new_empty(part.shape[0] // _world(group), *part.shape[1:])
    dist.reduce_scatter_tensor(recv, part.contiguous(), group=group)
    return recv


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _ColumnOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, nano: int, sequence_parallel: bool, keep_input: bool):
        OVERLAPPED[0] += nano >= 1
        x2 = _rows2d(x)
        ctx.save_for_backward(weight)
        ctx.group, ctx.sp, ctx.nano, ctx.lead = group, sequence_parallel, nano, x.shape[1:-1]
        ctx.set_materialize_grads(False)  # an unused input copy has no gradient to add
        if not sequence_parallel:
            return torch.matmul(x, weight.t()), (x.view_as(x) if keep_input else None)
        y, full = _gather_mm(x2, group, weight.t(), keep_input, nano >= 1)
        lead = (x.shape[0] * _world(group), *ctx.lead)
        return y.view(*lead, y.shape[-1]), (None if full is None else full.view(*lead, full.shape[-1]))

    @staticmethod
    def backward(ctx, dy, dfull):
        (weight,) = ctx.saved_tensors
        tp = _world(ctx.group)
        if dy is None and dfull is None:  # (grads are not materialised: no loss depends on either output)
            return None, None, None, None, None, None
        # the kept input's gradient (the LoRA branch's, partial over the ranks) joins dY·W before its one
        # reduction: the reduce-scatter (SP) or all-reduce sums both
        add = None if dfull is None else _rows2d(dfull).to(weight.dtype)
        if dy is None:
            dx = _reduce(add, ctx.group, ctx.sp)
        else:
            dy2 = _rows2d(dy).to(weight.dtype)
            dx = (_mm_scatter(dy2, ctx.group, weight, ctx.nano >= 1, add) if ctx.sp
                  else _mm_allreduce(dy2, ctx.group, weight, ctx.nano, add))
        rows = (dy if dy is not None else dfull).shape[0] // (tp if ctx.sp else 1)
        return dx.view(rows, *ctx.lead, dx.shape[-1]), None, None, None, None, None


class _RowOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, nano: int, sequence_parallel: bool, delta, then):
        OVERLAPPED[0] += nano >= 1
        x2, tp = _rows2d(x), _world(group)
        ctx.save_for_backward(weight)
        ctx.group, ctx.sp, ctx.nano, ctx.lead = group, sequence_parallel, nano, x.shape[1:-1]
        ctx.then = then
        ctx.set_materialize_grads(False)
        ctx.delta = delta is not None
        # the partial term joins the base's partial output before its one reduction
        add = None if delta is None else _rows2d(delta).to(x2.dtype)
        if not sequence_parallel:
            y = _mm_allreduce(x2, group, weight.t(), nano, add)
            return y.view(*x.shape[:-1], y.shape[-1])
        if x.shape[0] % tp:
            raise ValueError(f"row-parallel linear under sequence parallelism: {x.shape[0]} positions are "
                             f"not {tp} equal sequence shards")
        y = _mm_scatter(x2, group, weight.t(), nano >= 1, add)
        return y.view(x.shape[0] // tp, *ctx.lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        then, ctx.then = ctx.then, None
        if dy is None:
            return None, None, None, None, None, None, None
        dy2 = _rows2d(dy)
        full = None
        rows = dy.shape[0] * (_world(ctx.group) if ctx.sp else 1)
        if not ctx.sp:
            if then is not None:
                then()
            dx = torch.matmul(dy2.to(weight.dtype), weight)
            full = dy2 if ctx.delta else None
        elif ctx.delta and dy2.dtype != weight.dtype:  # the partial term's gradient in dY's own dtype
            full = gather_rows(dy2, ctx.group, _world(ctx.group))
            if then is not None:
                then()
            dx = torch.matmul(full.to(weight.dtype), weight)
        else:
            dx, full = _gather_mm(dy2.to(weight.dtype), ctx.group, weight, ctx.delta, ctx.nano >= 1, then)
        ddelta = None if full is None else full.view(rows, *ctx.lead, full.shape[-1])
        return dx.view(rows, *ctx.lead, dx.shape[-1]), None, None, None, None, ddelta, None


def column_linear_overlapped(x: torch.Tensor, weight: torch.Tensor, group, nano: int, *,
                             sequence_parallel: bool, keep_input: bool = False):
    """(X·Wᵀ of a column-parallel frozen ``weight`` [out/tp, in] on ``x`` [s(/tp), ..., in], its input or
    None): see the module docstring (``nano = 0``: the collectives in line). ``keep_input`` returns the
    input the GEMM saw — all-gathered under SP (Megatron's ``gather_from_sequence_parallel_region``), else
    ``x`` as it is — whose gradient is *partial* over the ranks (another term's on this rank's output
    columns, as dY·W): it is added to dY·W before the one reduce-scatter (SP) or all-reduce of dX."""
    return _ColumnOverlap.apply(x, weight, group, nano, sequence_parallel, keep_input)


def row_linear_overlapped(x: torch.Tensor, weight: torch.Tensor, group, nano: int, *,
                          sequence_parallel: bool, delta: torch.Tensor | None = None,
                          then=None) -> torch.Tensor:
    """Σ_ranks (X·Wᵀ + delta) of a row-parallel frozen ``weight`` [out, in/tp] on ``x`` [s, ..., in/tp]: this
    rank's sequence shard under SP (reduce-scattered), else all-reduced (``nano = 0``: the collectives in
    line). ``delta`` [s, ..., out]: a term *partial* over the ranks (another term's on this rank's input
    columns, as X·Wᵀ), added before the one reduction; its gradient is the whole dY (under SP the all-gathered
    dY the base's backward gathers anyway). ``then()``: called in backward once dY's all-gather (SP) is
    issued, before the GEMMs: a collective issued there (the prefetch of the saved input that the column
    linear before this one in forward gathers in its backward, :func:`lorafusion.ops.saved.rebuild_saved`)
    runs under them."""
    return _RowOverlap.apply(x, weight, group, nano, sequence_parallel, delta, then)
