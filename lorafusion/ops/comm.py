"""The tensor-parallel collectives of the LoRA term: on S (m×r), as autograd functions, where the LoRA term
is computed apart from the base layer; and the once-per-step sum of the gradients left partial where it rides
on the base layer's own collectives.

- column-parallel base (A replicated, B sharded on out-dim): S is identical on every rank, but each rank
  sees only its slice of dS = s·dY·B, so dS is all-reduced in backward (forward: identity).
- row-parallel base (A sharded on in-dim, B replicated): each rank holds a partial S, all-reduced in
  forward before B; dS is already complete on every rank (backward: identity).

Megatron's ``copy_to/reduce_from_tensor_model_parallel_region`` do the same on the default TP group;
these take an explicit group so ops/ does not depend on Megatron's global state.

Where the LoRA term shares the base layer's collectives (the TP linears of :mod:`lorafusion.ops.tp_overlap`)
neither S nor dS is reduced per linear: a row linear adds its partial s·S·Bᵀ to the base's partial output
before the base's reduce-scatter / all-reduce, a column linear adds its partial dX to the base's before the
base's reduce-scatter / all-reduce of dX. Every activation and activation gradient stays exact; what is left
partial over the TP ranks is the gradient of the replicated factor (a column linear's A: dA = dSᵀ·X from this
rank's dS; a row linear's B: dB = s·dYᵀ·S from this rank's S). Such a parameter is marked
(:func:`mark_partial_grad`) and its gradient, summed over the microbatches as usual, is summed over the TP
ranks once per optimizer step by :func:`sum_partial_grads` (one all-reduce for all of them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


PARTIAL_GRAD = "lora_tp_partial_grad"  # the attribute marking a parameter whose gradient is partial over TP


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _world(group) == 1:
            return x
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        if _world(ctx.group) == 1:
            return grad, None
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_in_forward(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceForward.apply(x, group)


def all_reduce_in_backward(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceBackward.apply(x, group)


def apply_s_comm(S: torch.Tensor, s_comm: str | None, group) -> torch.Tensor:
    """``s_comm``: None (no TP), "column" or "row" (see module doc)."""
    if s_comm is None:
        return S
    if s_comm == "row":
        return all_reduce_in_forward(S, group)
    if s_comm == "column":
        return all_reduce_in_backward(S, group)
    raise ValueError(f"s_comm: expected None, 'column' or 'row', got {s_comm!r}")


def mark_partial_grad(params) -> None:
    """Mark ``params`` (replicated over the TP ranks) as getting this rank's partial gradient (module doc)."""
    for p in params:
        if not getattr(p, PARTIAL_GRAD, False):
            setattr(p, PARTIAL_GRAD, True)


def is_partial_grad(p: torch.Tensor) -> bool:
    return bool(getattr(p, PARTIAL_GRAD, False))


def sum_partial_grads(params, group) -> int:
    """Sum over the ranks of ``group`` (the TP group) the gradients of the marked ones of ``params`` that have
    a gradient: one all-reduce of one flat buffer, written back into each ``.grad``; every rank must pass
    the same parameters in the same order (the TP ranks hold the same adapters and ran the same layers).
    Call it once per optimizer step, after the last backward of the step, before anything reads the
    gradients. Returns how many gradients were summed (0: no collective)."""
    if _world(group) == 1:
        return 0
    grads = [p.grad for p in params if p.grad is not None and is_partial_grad(p)]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads,
                                                                 strict=True)])
    return len(grads)
