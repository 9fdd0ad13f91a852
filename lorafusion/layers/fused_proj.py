"""PEFT's LoRA on Megatron's fused linears: an independent A and B per targeted projection.

``linear_qkv`` fuses q/k/v (rows interleaved per GQA query group: the group's q heads, its k head, its v
head) and ``linear_fc1`` fuses gate/up ([gate; up], under TP this rank's [gate shard; up shard]). For the
targeted projections T (any subset, in group order) an adapter holds

- A: the projections' A stacked, [|T|·r, in] (replicated under TP) — one shrink S = dropout(X)·Aᵀ of rank
  |T|·r;
- B: the rows of the targeted projections only, [rows of T on this rank, r], in the fused layout with the
  other rows left out (sharded like W under TP: a rank holds a contiguous 1/tp chunk of each projection).

The low-rank term is Σ_{p∈T} s·S_p·B_pᵀ written into p's rows of the fused output. :func:`block_b` hands
the LoRA ops the equivalent rank-|T|·r B, each row reading only its own projection's r columns of S (the
others zero; the zeros are built per call and receive no gradient: dB of the parameter is the gradient
of its own block), so the ops and kernels run it as one ordinary LoRA of rank |T|·r.
"""

from __future__ import annotations

import torch

from lorafusion.ops.tables import to_device

__all__ = ["block_b", "block_bs", "fused_projection_index", "merge_rows", "ops_b", "split_rows"]


def fused_projection_index(kind: str, rows: int, groups: int = 1, heads_per_group: int = 1,
                           kv_channels: int = 1) -> torch.Tensor:
    """The projection (0, 1, 2 = q, k, v of linear_qkv; 0, 1 = gate, up of linear_fc1) of each of ``rows``
    output rows of a fused linear in Megatron's layout: ``groups`` query groups (this rank's under TP) of
    ``heads_per_group`` q heads, one k and one v head of ``kv_channels`` rows each; or [gate; up] halves.
    A projection's rows keep their HF order, and a TP rank holds a contiguous 1/tp chunk of each."""
    if kind == "linear_fc1":
        if rows % 2:
            raise ValueError(f"linear_fc1: {rows} rows are not [gate; up] halves")
        return torch.arange(2).repeat_interleave(rows // 2)
    if kind != "linear_qkv":
        raise ValueError(f"{kind} is not a fused linear")
    one = torch.tensor([0] * (heads_per_group * kv_channels) + [1] * kv_channels + [2] * kv_channels)
    if one.numel() * groups != rows:
        raise ValueError(f"linear_qkv: {rows} rows are not {groups} groups of "
                         f"({heads_per_group}+2)x{kv_channels}")
    return one.repeat(groups)


def _targeted(proj_index: torch.Tensor, chosen: tuple[int, ...]) -> torch.Tensor:
    return torch.isin(proj_index, torch.tensor(chosen, dtype=proj_index.dtype))


def split_rows(b: torch.Tensor, proj_index: torch.Tensor, chosen: tuple[int, ...]) -> list[torch.Tensor]:
    """A compact B (rows of the ``chosen`` projections, fused order) → one tensor per chosen projection."""
    sub = proj_index[_targeted(proj_index, chosen)]
    if sub.numel() != b.shape[0]:
        raise ValueError(f"lora_B has {b.shape[0]} rows, the targeted projections {sub.numel()}")
    return [b[sub == p] for p in chosen]


def merge_rows(parts: list[torch.Tensor], proj_index: torch.Tensor, chosen: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`split_rows`."""
    sub = proj_index[_targeted(proj_index, chosen)]
    out = parts[0].new_empty((sub.numel(), *parts[0].shape[1:]))
    for p, part in zip(chosen, parts, strict=True):
        rows = int((sub == p).sum())
        if part.shape[0] != rows:
            raise ValueError(f"projection {p}: expected {rows} rows, got {part.shape[0]}")
        out[sub == p] = part
    return out


class BlockIndex:
    """Where a compact B's rows go in the rank-|T|·r block B: (fused row, projection slot) per row."""

    def __init__(self, proj_index: torch.Tensor, chosen: tuple[int, ...], device) -> None:
        mask = _targeted(proj_index, chosen)
        slot_of = {p: i for i, p in enumerate(chosen)}
        self.rows_total = proj_index.numel()
        self.n_proj = len(chosen)
        # built at a layer's first forward, which may be inside a pipeline schedule: pinned, non-blocking
        # copies (a blocking one synchronises the stream; see lorafusion.data.packing.PackedBatch.to)
        self.rows = to_device(torch.nonzero(mask).flatten(), device)
        self.slots = to_device(torch.tensor([slot_of[int(p)] for p in proj_index[mask]], dtype=torch.long),
                               device)
        self.whole = bool(mask.all())


def block_b(b: torch.Tensor, index: BlockIndex) -> torch.Tensor:
    """Compact B [rows of T, r] → the block B [rows, |T|·r] (row i non-zero only in its projection's r
    columns); differentiable in ``b``."""
    r = b.shape[1]
    if index.n_proj == 1 and index.whole:
        return b
    full = b.new_zeros((index.rows_total, index.n_proj, r))
    full = full.index_put((index.rows, index.slots), b)
    return full.view(index.rows_total, index.n_proj * r)


class JointBlockIndex:
    """Several adapters' :class:`BlockIndex` of one fused linear side by side, all of rank ``r``: adapter i's
    block B is columns ``spans[i]`` of one [rows, Σ|T_i|·r] tensor, filled from the compact B's stacked."""

    def __init__(self, indexes: list[BlockIndex], r: int) -> None:
        self.rows_total, self.r = indexes[0].rows_total, r
        offs, off = [], 0
        for ix in indexes:
            offs.append(off)
            off += ix.n_proj
        self.groups = off
        self.spans = [(o * r, ix.n_proj * r) for o, ix in zip(offs, indexes, strict=True)]
        self.counts = [ix.rows.numel() for ix in indexes]
        self.rows = torch.cat([ix.rows for ix in indexes])
        self.cols = torch.cat([ix.slots + o for o, ix in zip(offs, indexes, strict=True)])
        self.parts = indexes


class _JointBlockB(torch.autograd.Function):
    """The block B's of several adapters in one pass (see :class:`JointBlockIndex`): a zero tensor, one
    scatter of the stacked compact B's; each output a column span of it. Backward gathers each compact
    gradient from its block's gradient (an adapter without rows in the batch gets none, as with
    :func:`block_b`)."""

    @staticmethod
    def forward(ctx, joint: JointBlockIndex, *bs):
        ctx.set_materialize_grads(False)
        ctx.joint = joint
        full = bs[0].new_zeros((joint.rows_total, joint.groups * joint.r))
        vals = torch.cat(bs) if len(bs) > 1 else bs[0]
        full.view(joint.rows_total, joint.groups, joint.r).index_put_((joint.rows, joint.cols), vals)
        return tuple(full.narrow(1, off, width) for off, width in joint.spans)

    @staticmethod
    def backward(ctx, *grads):
        joint = ctx.joint
        if all(g is not None for g in grads):
            g = torch.cat(grads, 1) if len(grads) > 1 else grads[0]
            flat = g.reshape(joint.rows_total, joint.groups, joint.r)[joint.rows, joint.cols]
            return (None, *flat.split(joint.counts))
        out = []
        for g, ix in zip(grads, joint.parts, strict=True):
            out.append(None if g is None else g.reshape(ix.rows_total, ix.n_proj, joint.r)[ix.rows, ix.slots])
        return (None, *out)


def block_bs(bs: list[torch.Tensor], joint: JointBlockIndex) -> list[torch.Tensor]:
    """:func:`block_b` of every adapter of ``joint`` at once (the same values and gradients, fewer ops)."""
    return list(_JointBlockB.apply(joint, *bs))


def ops_b(bs: list[torch.Tensor], chosen: tuple, cache: dict, projection_index) -> list[torch.Tensor]:
    """A fused linear's adapter B's as the LoRA ops take them: ``chosen[i]`` (adapter i's projections, None
    for a B taken as it is) gives adapter i's block B; of equal ranks all in one pass (:func:`block_bs`).
    ``cache``: the linear's index cache; ``projection_index()``: its row → projection index."""
    if all(c is None for c in chosen):
        return bs
    ix = []
    for c, b in zip(chosen, bs, strict=True):
        key = (c, str(b.device))
        if c is not None and key not in cache:
            cache[key] = BlockIndex(projection_index(), c, b.device)
        ix.append(None if c is None else cache[key])
    r = bs[0].shape[1]
    if len(bs) == 1 or None in chosen or any(b.shape[1] != r for b in bs):
        return [b if i is None else block_b(b, i) for b, i in zip(bs, ix, strict=True)]
    key = ("joint", chosen, r, str(bs[0].device))
    if key not in cache:
        cache[key] = JointBlockIndex(ix, r)
    return block_bs(bs, cache[key])
