"""Megatron ↔ HF tensor layouts for the fused linears, and tensor-parallel sharding of them.

linear_qkv rows are interleaved per GQA query group: for each group g, its (heads/groups) query heads,
then its key head, then its value head (each head ``kv_channels`` rows). linear_fc1 rows are
[gate; up]; under TP each rank holds [gate_shard; up_shard].
"""

from __future__ import annotations

import torch

from lorafusion.core.arch import ModelArch


def qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """HF q/k/v (rows = out features; any trailing dims) → Megatron interleaved linear_qkv rows."""
    ng, hn = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // ng
    tail = q.shape[1:]
    qg = q.reshape(ng, per * hn, *tail)
    kg = k.reshape(ng, hn, *tail)
    vg = v.reshape(ng, hn, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (per + 2) * hn, *tail)


def qkv_split(x: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_merge`."""
    ng, hn = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // ng
    tail = x.shape[1:]
    g = x.reshape(ng, (per + 2) * hn, *tail)
    q = g[:, : per * hn].reshape(ng * per * hn, *tail)
    k = g[:, per * hn:(per + 1) * hn].reshape(ng * hn, *tail)
    v = g[:, (per + 1) * hn:].reshape(ng * hn, *tail)
    return q, k, v


def shard(x: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Contiguous 1/tp chunk along ``dim`` (Megatron's partitioning of W for column/row parallel)."""
    if x.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={tp}")
    return x.chunk(tp, dim=dim)[rank].contiguous()


def fc1_shard(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """[gate; up] full rows → this rank's [gate_shard; up_shard]."""
    gate, up = full.chunk(2, dim=0)
    return torch.cat([shard(gate, 0, tp, rank), shard(up, 0, tp, rank)], dim=0)


def fc1_unshard(shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`fc1_shard` over all ranks' shards."""
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
    return torch.cat([torch.cat(gates, 0), torch.cat(ups, 0)], 0)


def column_shard(kind: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rows of a column-parallel weight/bias/LoRA-B for this rank (qkv groups are contiguous)."""
    return fc1_shard(full, tp, rank) if kind == "linear_fc1" else shard(full, 0, tp, rank)


def column_unshard(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    return fc1_unshard(shards) if kind == "linear_fc1" else torch.cat(shards, 0)
