"""Plain-torch multi-adapter LoRA: the ground truth and the CPU path.

For rows of adapter slot ``a`` (see :class:`~lorafusion.ops.routing.Routing`)::

    S = (D_a ⊙ X)·A_aᵀ / (1-p_a)          (m×r_a; D_a regenerated from (seed_a, row id, column))
    Δ = s_a · S·B_aᵀ

Autograd of these torch ops gives the backward. S is packed as [m, r_max] (zero beyond r_a) so that one
collective serves every adapter under tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.ops.comm import apply_s_comm
from lorafusion.ops.dropout import keep_mask
from lorafusion.ops.routing import Routing


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
    ids = routing.ids(x2d.device)
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


def multi_lora_delta_reference(x: torch.Tensor, lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                               scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                               routing: Routing, *, k_offset: int = 0, k_total: int | None = None,
                               s_comm: str | None = None, tp_group=None) -> torch.Tensor:
    """The LoRA term only (add it to the base output). ``x``: [..., k] → [..., n]."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] != routing.num_rows:
        raise ValueError(f"routing covers {routing.num_rows} rows but the input has {x2d.shape[0]}")
    S = lora_shrink_reference(x2d, lora_A, dropout_p, seeds, routing, k_offset, k_total)
    S = apply_s_comm(S, s_comm, tp_group)
    delta = lora_expand_reference(S, lora_B, scaling, routing)
    return delta.reshape(*lead, delta.shape[-1])
