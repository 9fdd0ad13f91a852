"""The LoRA parallel linears with their tensor-parallel collectives overlapped with compute
(``parallelism.tp_overlap``; the model config's ``tp_overlap``: 0 = off, else on, with that many nano-batches
of rows for the all-reduces without sequence parallelism).

The frozen base runs through :mod:`lorafusion.ops.tp_overlap` (each collective in flight while the GEMM of
rows that do not wait for it runs); the LoRA term of every adapter is computed in the same layer call around
it, on the same tensors as without overlap, so every adapter's output and gradients are the ones of Megatron's
path (:class:`lorafusion.layers.lora_linear.LoRALinear`):

- column-parallel: the base returns the all-gathered input along with its output (SP), and the LoRA term is
  computed on that gathered input: no second all-gather of the same rows (Megatron's path gathers once for the
  base and once more for the LoRA term). Its gradient is split back inside the base's backward, next to the
  reduce-scatter of the base's dX.
- row-parallel: the LoRA term first (its all-reduce of S, m×r, is small and would otherwise queue on the
  communicator behind the base's reduce-scatters), then the base's GEMMs with their reduce-scatter (SP) or
  all-reduce in flight.

Where it does not apply the linear keeps Megatron's path: tp = 1, an FP8 base (its own GEMM), a trainable
base weight (dW), a column linear that gathers its output, a row linear whose input is not split.
"""

from __future__ import annotations

import contextlib

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

from lorafusion.layers.fp8_base import is_fp8
from lorafusion.ops.tp_overlap import column_linear_overlapped, row_linear_overlapped

__all__ = ["overlapped_forward", "tp_overlap_nano"]


def tp_overlap_nano(linear, args=(), kwargs=None) -> int:
    """How many nano-batches ``linear``'s forward overlaps its TP collectives with (its config's
    ``tp_overlap``), or 0 where the overlapped path does not apply (module docstring)."""
    nano = int(getattr(linear.config, "tp_overlap", 0) or 0)
    if nano < 1 or args or kwargs or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return 0
    if linear.weight is None or is_fp8(linear) or linear.weight.requires_grad:
        return 0
    if getattr(linear, "gather_output", False) or not getattr(linear, "input_is_parallel", True):
        return 0
    return nano


def overlapped_forward(linear, input_, largs, nano: int, shard_hooks=None):
    """(output, bias) of ``linear`` as Megatron's forward gives them, the base overlapped; ``largs``: its LoRA
    arguments (``LoRALinear._lora_args``) or None; ``shard_hooks(full, shard)``: the saved-tensor hooks that
    keep the LoRA term's saved gathered input as this rank's sequence shard (SP)."""
    group = getattr(linear, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    sp, bias = linear.sequence_parallel, linear.bias
    add_bias = bias is not None and not linear.skip_bias_add
    if linear.s_comm_mode == "column":
        y, full = column_linear_overlapped(input_, linear.weight, group, nano, sequence_parallel=sp,
                                           keep_input=largs is not None)
        if add_bias:
            y = y + bias
        if largs is not None:
            x = full if sp else input_
            hooks = shard_hooks(full, input_) if sp and shard_hooks else contextlib.nullcontext()
            with hooks:
                y = y + linear._lora_delta(x, largs)
    else:
        delta = None
        if largs is not None:
            delta = linear._lora_delta(input_, largs)
            if sp:
                delta = scatter_to_sequence_parallel_region(delta)
        y = row_linear_overlapped(input_, linear.weight, group, nano, sequence_parallel=sp)
        if delta is not None:
            y = y + delta
        if add_bias:
            y = y + bias
    return y, (bias if linear.skip_bias_add else None)
