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
  of gathering the same rows again; its gradient (whole on every rank) is split back.
- Without SP (all-reduce: column backward's dX, row forward's Y): the rows in ``nano`` contiguous
  nano-batches (:func:`nano_bounds`), the all-reduce of one in flight while the next one's GEMM runs.

Every op inside is row-wise (a GEMM), so no split changes a result; attention, the one op that mixes rows, is
never split. Outputs are in Megatron's layout, so nothing after the linear changes; numbers equal the unsplit
linear up to the GEMMs' summation order (and, for a reduce-scatter, the order of the ranks' sum).

``nano = 0``: the same linears with their collectives in line (one collective, one GEMM, nothing split) — the
LoRA layers' TP path without overlap, which keeps the one gathered input and the one collective per direction.
A row linear under SP also takes the LoRA term's full-sequence ``delta`` (identical on every rank): its shard
is added to the reduce-scattered output, and its gradient is the all-gathered dY the base's backward gathers
anyway (one all-gather for both, where ``scatter_to_sequence_parallel_region`` would gather dY again).
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


def gather_rows(local: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The ranks' ``local`` tensors stacked along dim 0 in rank order (Megatron's sequence-parallel layout):
    one all-gather, no Megatron group look-up."""
    full = local.new_empty((tp * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(full, local.contiguous(), group=group)
    return full


def _gather_mm(local: torch.Tensor, group, w: torch.Tensor, keep: bool, overlap: bool = True):
    """(``all_gather(local) @ w`` in Megatron's gathered layout — rank q's rows at [q·m, (q+1)·m) — and the
    gathered input, or None unless ``keep``): one all-gather in flight while this rank's own block, which
    needs nothing gathered, is multiplied; then the other ranks' blocks. Every GEMM writes its rows of the
    output in place (no copies). Without ``overlap``: the all-gather, then one GEMM."""
    tp, r, (m, k) = _world(group), _rank(group), local.shape
    if not overlap:
        full = gather_rows(local, group, tp)
        return torch.matmul(full, w), (full if keep else None)
    local = local.contiguous()
    full = local.new_empty(tp * m, k)
    work = dist.all_gather_into_tensor(full, local, group=group, async_op=True)
    out = local.new_empty(tp * m, w.shape[-1])
    torch.matmul(local, w, out=out[r * m:(r + 1) * m])
    work.wait()
    for a, b in _others(tp, r, m):
        torch.matmul(full[a:b], w, out=out[a:b])
    return out, (full if keep else None)


def _mm_scatter(full: torch.Tensor, group, w: torch.Tensor, overlap: bool = True) -> torch.Tensor:
    """``reduce_scatter(full @ w)`` (``full`` in the gathered layout; this rank's m rows come back): the other
    ranks' blocks first, into the send buffer whose own block is zero; the reduce-scatter in flight while
    the own block is multiplied; then the two added. Without ``overlap``: one GEMM, then the
    reduce-scatter."""
    tp, r = _world(group), _rank(group)
    m = full.shape[0] // tp
    if not overlap:
        buf = torch.matmul(full, w)
        recv = buf.new_empty(m, w.shape[-1])
        dist.reduce_scatter_tensor(recv, buf, group=group)
        return recv
    buf = full.new_empty(tp * m, w.shape[-1])
    for a, b in _others(tp, r, m):
        torch.matmul(full[a:b], w, out=buf[a:b])
    buf[r * m:(r + 1) * m].zero_()
    recv = buf.new_empty(m, w.shape[-1])
    work = dist.reduce_scatter_tensor(recv, buf, group=group, async_op=True)
    own = torch.matmul(full[r * m:(r + 1) * m], w)
    work.wait()
    return own.add_(recv)


def _mm_allreduce(x: torch.Tensor, group, w: torch.Tensor, nano: int) -> torch.Tensor:
    """``all_reduce(x @ w)`` in nano-batches of rows: the all-reduce of one in flight while the next one's
    GEMM runs, each GEMM writing its rows of the output in place. ``nano = 0``: one GEMM, one all-reduce."""
    if nano < 1:
        out = torch.matmul(x, w)
        dist.all_reduce(out, group=group)
        return out
    out = x.new_empty(x.shape[0], w.shape[-1])
    works = []
    for a, b in nano_bounds(x.shape[0], nano):
        torch.matmul(x[a:b], w, out=out[a:b])
        works.append(dist.all_reduce(out[a:b], group=group, async_op=True))
    for work in works:
        work.wait()
    return out


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _ColumnOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, nano: int, sequence_parallel: bool, keep_input: bool):
        OVERLAPPED[0] += nano >= 1
        x2 = _rows2d(x)
        ctx.save_for_backward(weight)
        ctx.group, ctx.sp, ctx.nano, ctx.lead = group, sequence_parallel, nano, x.shape[1:-1]
        ctx.set_materialize_grads(False)  # an unused gathered input has no gradient to split back
        if not sequence_parallel:
            return torch.matmul(x, weight.t()), None
        y, full = _gather_mm(x2, group, weight.t(), keep_input, nano >= 1)
        lead = (x.shape[0] * _world(group), *ctx.lead)
        return y.view(*lead, y.shape[-1]), (None if full is None else full.view(*lead, full.shape[-1]))

    @staticmethod
    def backward(ctx, dy, dfull):
        (weight,) = ctx.saved_tensors
        tp, r = _world(ctx.group), _rank(ctx.group)
        dx = None
        if dy is not None:  # (grads are not materialised: an output no loss depends on brings None)
            dy2 = _rows2d(dy).to(weight.dtype)
            dx = (_mm_scatter(dy2, ctx.group, weight, ctx.nano >= 1) if ctx.sp
                  else _mm_allreduce(dy2, ctx.group, weight, ctx.nano))
        if dfull is not None:  # the LoRA branch's gradient of the gathered input: whole on every rank
            d2 = _rows2d(dfull)
            m = d2.shape[0] // tp
            dx = d2[r * m:(r + 1) * m].clone() if dx is None else dx.add_(d2[r * m:(r + 1) * m])
        if dx is None:
            return None, None, None, None, None, None
        rows = (dy if dy is not None else dfull).shape[0] // (tp if ctx.sp else 1)
        return dx.view(rows, *ctx.lead, dx.shape[-1]), None, None, None, None, None


class _RowOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, nano: int, sequence_parallel: bool, delta):
        OVERLAPPED[0] += nano >= 1
        x2, tp = _rows2d(x), _world(group)
        ctx.save_for_backward(weight)
        ctx.group, ctx.sp, ctx.nano, ctx.lead = group, sequence_parallel, nano, x.shape[1:-1]
        ctx.set_materialize_grads(False)
        ctx.delta = delta is not None
        if not sequence_parallel:
            y = _mm_allreduce(x2, group, weight.t(), nano)
            return y.view(*x.shape[:-1], y.shape[-1])
        if x.shape[0] % tp:
            raise ValueError(f"row-parallel linear under sequence parallelism: {x.shape[0]} positions are "
                             f"not {tp} equal sequence shards")
        y = _mm_scatter(x2, group, weight.t(), nano >= 1)
        m = x.shape[0] // tp
        y = y.view(m, *ctx.lead, y.shape[-1])
        if delta is not None:  # this rank's rows of the full-sequence LoRA term
            r = _rank(group)
            own = delta[r * m:(r + 1) * m]
            y = y.add_(own) if own.dtype == y.dtype else y + own
        return y

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        if dy is None:
            return None, None, None, None, None, None
        dy2 = _rows2d(dy)
        full = None
        rows = dy.shape[0] * (_world(ctx.group) if ctx.sp else 1)
        if not ctx.sp:
            dx = torch.matmul(dy2.to(weight.dtype), weight)
        elif ctx.delta and dy2.dtype != weight.dtype:  # the LoRA term's gradient in dY's own dtype
            full = gather_rows(dy2, ctx.group, _world(ctx.group))
            dx = torch.matmul(full.to(weight.dtype), weight)
        else:
            dx, full = _gather_mm(dy2.to(weight.dtype), ctx.group, weight, ctx.delta, ctx.nano >= 1)
        ddelta = None if full is None else full.view(rows, *ctx.lead, full.shape[-1])
        return dx.view(rows, *ctx.lead, dx.shape[-1]), None, None, None, None, ddelta


def column_linear_overlapped(x: torch.Tensor, weight: torch.Tensor, group, nano: int, *,
                             sequence_parallel: bool, keep_input: bool = False):
    """(X·Wᵀ of a column-parallel frozen ``weight`` [out/tp, in] on ``x`` [s(/tp), ..., in], the gathered
    input or None): see the module docstring (``nano = 0``: the collectives in line). ``keep_input`` (SP
    only) returns the all-gathered input, whose gradient is split back to this rank's rows (Megatron's
    ``gather_from_sequence_parallel_region`` with ``tensor_parallel_output_grad=False``)."""
    return _ColumnOverlap.apply(x, weight, group, nano, sequence_parallel, keep_input and sequence_parallel)


def row_linear_overlapped(x: torch.Tensor, weight: torch.Tensor, group, nano: int, *,
                          sequence_parallel: bool, delta: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_ranks X·Wᵀ of a row-parallel frozen ``weight`` [out, in/tp] on ``x`` [s, ..., in/tp]: this rank's
    sequence shard under SP (reduce-scattered), else all-reduced (``nano = 0``: the collectives in line).
    ``delta`` (SP only): a full-sequence term [s, ..., out], identical on every rank, whose rows of this
    rank's shard are added to the output; its gradient is the all-gathered dY the base's backward gathers."""
    if delta is not None and not sequence_parallel:
        raise ValueError("row_linear_overlapped: delta is for sequence parallelism (without it add it after)")
    return _RowOverlap.apply(x, weight, group, nano, sequence_parallel, delta)
