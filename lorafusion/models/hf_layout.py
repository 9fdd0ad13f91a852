"""Megatron ↔ HF row order of the fused linear_qkv.

linear_qkv rows are interleaved per GQA query group: for each group g, its (heads/groups) query heads,
then its key head, then its value head (each head ``kv_channels`` rows). linear_fc1 rows are [gate; up].
How either is split across TP ranks is the parallel linear's to say (:mod:`lorafusion.layers.sharding`).
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
