"""Tensor-parallel linears whose collectives overlap their own GEMMs: the rows (tokens) of the input split
into nano-batches, the collective of one nano-batch in flight (``async_op=True``, NCCL's stream) while the
GEMM of another runs on the compute stream. Plain NCCL / gloo collectives only (no symmetric memory, no
multicast).

The frozen base W of a Megatron parallel linear (no dW: the base is frozen in LoRA), per pattern:

- column-parallel, sequence parallel: forward all-gathers the input's sequence shard, then X·Wᵀ; backward
  dY·W, then reduce-scatters dX. Overlapped: all-gather nano-batch j+1 ‖ GEMM j (forward); GEMM j+1 ‖
  reduce-scatter j (backward). The gathered input comes back too (``keep_input``), so the LoRA term reuses it
  instead of gathering the same rows again; its gradient (already complete on every rank) is split back.
- column-parallel without SP: forward has no collective; backward all-reduces dX (GEMM j+1 ‖ all-reduce j).
- row-parallel, SP: forward X·Wᵀ then reduce-scatter (GEMM j+1 ‖ reduce-scatter j); backward all-gathers dY
  (all-gather j+1 ‖ GEMM j). Without SP: forward all-reduces Y (GEMM j+1 ‖ all-reduce j); backward has none.

Under SP nano-batch j is the same row range [a, b) of every rank's sequence shard, so its gathered rows are
rank blocks of the full sequence; they are written back to their places, so every output is in Megatron's
layout and nothing after the linear changes. Every op inside is row-wise (a GEMM), so the split changes no
result; attention, the one op that mixes rows, is never split. Numbers equal the unsplit linear up to the
GEMMs' own summation order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["OVERLAPPED", "column_linear_overlapped", "nano_bounds", "row_linear_overlapped"]

OVERLAPPED = [0]  # how many overlapped linear forwards ran (tests read it)


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


def _gather_mm(local: torch.Tensor, group, bounds, mm, keep: bool):
    """``mm(all_gather(local))`` in Megatron's gathered layout (rank r's rows at [r·m, (r+1)·m)), one
    nano-batch at a time: the gather of j+1 is issued before the GEMM of j. ``keep``: also the gathered input
    (else None)."""
    tp, (m, k) = _world(group), local.shape
    local = local.contiguous()

    def issue(j):
        a, b = bounds[j]
        buf = local.new_empty(tp * (b - a), k)
        return buf, dist.all_gather_into_tensor(buf, local[a:b], group=group, async_op=True)

    out, full = None, (local.new_empty(tp * m, k) if keep else None)
    pending = issue(0)
    for j, (a, b) in enumerate(bounds):
        buf, work = pending
        if j + 1 < len(bounds):
            pending = issue(j + 1)
        work.wait()
        y = mm(buf)
        if out is None:
            out = y.new_empty(tp * m, y.shape[-1])
        out.view(tp, m, -1)[:, a:b] = y.view(tp, b - a, -1)
        if keep:
            full.view(tp, m, k)[:, a:b] = buf.view(tp, b - a, k)
    return out, full


def _mm_reduce(full: torch.Tensor, group, bounds, mm, scatter: bool) -> torch.Tensor:
    """``reduce_scatter(mm(full))`` (``scatter``: ``full`` in the gathered layout, tp blocks of m rows; this
    rank's m rows come back) or ``all_reduce(mm(full))``, one nano-batch at a time: the collective of j is
    in flight while the GEMM of j+1 runs."""
    tp = _world(group)
    blocks = tp if scatter else 1
    m = full.shape[0] // blocks
    out, works = None, []
    for a, b in bounds:
        part = full.view(blocks, m, -1)[:, a:b].reshape(blocks * (b - a), -1)
        y = mm(part)
        if out is None:
            out = y.new_empty(m, y.shape[-1])
        if scatter:
            works.append(dist.reduce_scatter_tensor(out[a:b], y, group=group, async_op=True))
        else:
            out[a:b] = y
            works.append(dist.all_reduce(out[a:b], group=group, async_op=True))
    for work in works:
        work.wait()
    return out


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _ColumnOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, nano: int, sequence_parallel: bool, keep_input: bool):
        x2 = _rows2d(x)
        tp = _world(group)
        OVERLAPPED[0] += 1
        ctx.save_for_backward(weight)
        ctx.group, ctx.sp, ctx.lead = group, sequence_parallel, x.shape[1:-1]
        ctx.bounds = nano_bounds(x2.shape[0], nano)
        if not sequence_parallel:
            y, full = torch.matmul(x2, weight.t()), None
        else:
            y, full = _gather_mm(x2, group, ctx.bounds, lambda a: torch.matmul(a, weight.t()), keep_input)
        lead = (x.shape[0] * (tp if sequence_parallel else 1), *ctx.lead)
        y = y.view(*lead, y.shape[-1])
        ctx.set_materialize_grads(False)  # an unused gathered input has no gradient to split back
        return y, (None if full is None else full.view(*lead, full.shape[-1]))

    @staticmethod
    def backward(ctx, dy, dfull):
        (weight,) = ctx.saved_tensors
        dy2 = _rows2d(dy).to(weight.dtype)
        dx = _mm_reduce(dy2, ctx.group, ctx.bounds, lambda a: torch.matmul(a, weight), ctx.sp)
        if dfull is not None:  # the LoRA branch's gradient of the gathered input: whole on every rank
            rank, m = dist.get_rank(ctx.group), dx.shape[0]
            dx = dx + _rows2d(dfull)[rank * m:(rank + 1) * m]
        lead = (dy.shape[0] // (_world(ctx.group) if ctx.sp else 1), *ctx.lead)
        return dx.view(*lead, dx.shape[-1]), None, None, None, None, None


class _RowOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, nano: int, sequence_parallel: bool):
        x2 = _rows2d(x)
        tp = _world(group)
        OVERLAPPED[0] += 1
        ctx.save_for_backward(weight)
        ctx.group, ctx.sp, ctx.lead = group, sequence_parallel, x.shape[1:-1]
        m = x2.shape[0] // (tp if sequence_parallel else 1)
        if sequence_parallel and m * tp != x2.shape[0]:
            raise ValueError(f"row-parallel linear under sequence parallelism: {x2.shape[0]} rows are not "
                             f"{tp} equal sequence shards")
        ctx.bounds = nano_bounds(m, nano)
        y = _mm_reduce(x2, group, ctx.bounds, lambda a: torch.matmul(a, weight.t()), sequence_parallel)
        return y.view(x.shape[0] // (tp if sequence_parallel else 1), *ctx.lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        dy2 = _rows2d(dy).to(weight.dtype)
        if ctx.sp:
            dx, _ = _gather_mm(dy2, ctx.group, ctx.bounds, lambda a: torch.matmul(a, weight), False)
        else:
            dx = torch.matmul(dy2, weight)
        rows = dy.shape[0] * (_world(ctx.group) if ctx.sp else 1)
        return dx.view(rows, *ctx.lead, dx.shape[-1]), None, None, None, None


def column_linear_overlapped(x: torch.Tensor, weight: torch.Tensor, group, nano: int, *,
                             sequence_parallel: bool, keep_input: bool = False):
    """(X·Wᵀ of a column-parallel frozen ``weight`` [out/tp, in] on ``x`` [s(/tp), ..., in], the gathered
    input or None): see the module docstring. ``keep_input`` (SP only) returns the all-gathered input, whose
    gradient is split back to this rank's rows (Megatron's ``gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``)."""
    return _ColumnOverlap.apply(x, weight, group, nano, sequence_parallel, keep_input and sequence_parallel)


def row_linear_overlapped(x: torch.Tensor, weight: torch.Tensor, group, nano: int, *,
                          sequence_parallel: bool) -> torch.Tensor:
    """Σ_ranks X·Wᵀ of a row-parallel frozen ``weight`` [out, in/tp] on ``x`` [s, ..., in/tp]: this rank's
    sequence shard under SP (reduce-scattered), else all-reduced."""
    return _RowOverlap.apply(x, weight, group, nano, sequence_parallel)
