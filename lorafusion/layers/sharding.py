"""How a tensor of a tensor-parallel layer is split across TP ranks (:class:`TPSplit`), and who says so.

The parallel linears own their sharding: ``LoRAColumnParallelLinear.tp_split`` and
``LoRARowParallelLinear.tp_split`` (:mod:`lorafusion.layers.lora_linear`) name the split of each of their
tensors — the base ``weight`` and ``bias``, the adapters' ``lora_A`` and ``lora_B``, and ``lora_B_proj`` (one
projection's B of a fused linear). :func:`param_split` asks a module for one of its parameters (Megatron's
own vocab-parallel embedding and output layer answer here: rows split). Random init
(``models.provider.init_random_weights``), HF import (``models.hf_import``), PEFT import and export
(``export.peft``) and ``add_lora`` take the split from there and only call :meth:`TPSplit.shard` /
:meth:`TPSplit.unshard`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class TPSplit:
    """One tensor's split over the TP ranks: rank ``r`` holds the ``r``-th contiguous 1/tp chunk along
    ``dim`` (Megatron's partitioning of W), or the whole tensor when ``dim`` is None (replicated).
    ``halves``: the rows are two stacked halves split on their own ([gate; up] of linear_fc1: a rank holds
    [gate shard; up shard])."""

    dim: int | None = None
    halves: bool = False

    def shard(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """This rank's part of the full tensor."""
        if self.dim is None:
            return full
        if self.halves:
            gate, up = full.chunk(2, dim=self.dim)
            return torch.cat([_chunk(gate, self.dim, tp, rank), _chunk(up, self.dim, tp, rank)], dim=self.dim)
        return _chunk(full, self.dim, tp, rank)

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (inverse of :meth:`shard`)."""
        if self.dim is None:
            return parts[0]
        if self.halves:
            gates, ups = zip(*(p.chunk(2, dim=self.dim) for p in parts), strict=True)
            return torch.cat([torch.cat(gates, self.dim), torch.cat(ups, self.dim)], self.dim)
        return torch.cat(parts, self.dim)

    def local_shape(self, full_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        """The shape of one rank's part of a tensor of ``full_shape``."""
        if self.dim is None:
            return tuple(full_shape)
        out = list(full_shape)
        out[self.dim] //= tp
        return tuple(out)

    def full_shape(self, local_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        """The shape of the full tensor whose rank parts have ``local_shape``."""
        if self.dim is None:
            return tuple(local_shape)
        out = list(local_shape)
        out[self.dim] *= tp
        return tuple(out)


REPLICATED = TPSplit()
ROWS = TPSplit(0)  # the out-features of a column-parallel W (and Megatron's vocab-parallel embedding)
COLUMNS = TPSplit(1)  # the in-features of a row-parallel W
ROW_HALVES = TPSplit(0, halves=True)  # linear_fc1's [gate; up] rows


def _chunk(x: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    if x.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={tp}")
    return x.chunk(tp, dim=dim)[rank].contiguous()


def param_split(module: torch.nn.Module, name: str) -> TPSplit:
    """The split of ``module``'s own parameter ``name``: what the module's ``tp_split`` says (our parallel
    linears); Megatron's vocab-parallel embedding and a plain column-parallel linear (the output layer)
    split their weight's rows; anything else (norms, rotary tables) is replicated."""
    own = getattr(module, "tp_split", None)
    if own is not None:
        return own(name)
    if isinstance(module, VocabParallelEmbedding) and name == "weight":
        return ROWS
    if isinstance(module, ColumnParallelLinear) and name in ("weight", "bias"):
        return ROWS
    if isinstance(module, RowParallelLinear) and name == "weight":
        return COLUMNS
    return REPLICATED


def tp_rank() -> tuple[int, int]:
    """(TP world size, this rank's TP rank) from Megatron's parallel state."""
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


__all__ = ["COLUMNS", "REPLICATED", "ROWS", "ROW_HALVES", "TPSplit", "param_split", "tp_rank"]
