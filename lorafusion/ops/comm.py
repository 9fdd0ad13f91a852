"""The one tensor-parallel collective LoRA needs, on S (m×r), as autograd functions.

- column-parallel base (A replicated, B sharded on out-dim): S is identical on every rank, but each rank
  sees only its slice of dS = s·dY·B, so dS is all-reduced in backward (forward: identity).
- row-parallel base (A sharded on in-dim, B replicated): each rank holds a partial S, all-reduced in
  forward before B; dS is already complete on every rank (backward: identity).

Megatron's ``copy_to/reduce_from_tensor_model_parallel_region`` do the same on the default TP group;
these take an explicit group so ops/ does not depend on Megatron's global state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
