"""The LoRA parallel linears' tensor-parallel forward: the frozen base with its TP collectives — overlapped
with compute (``parallelism.tp_overlap``; the model config's ``tp_overlap``: 0 = off, else on, with that many
nano-batches of rows for the all-reduces without sequence parallelism) or in line (off) — and the LoRA terms
sharing those collectives.

The frozen base runs through :mod:`lorafusion.ops.tp_overlap` (overlapped: each collective in flight while the
GEMM of rows that do not wait for it runs); the LoRA term of every adapter is computed in the same layer call
around it, on the same tensors as Megatron's path, so every adapter's output and gradients are the ones of
Megatron's path (:class:`lorafusion.layers.lora_linear.LoRALinear`), with fewer collectives under SP:

- column-parallel: the base returns the all-gathered input along with its output (SP), and the LoRA term is
  computed on that gathered input: no second all-gather of the same rows (Megatron's path gathers once for the
  base and once more for the LoRA term). Its gradient is split back inside the base's backward, next to the
  one reduce-scatter of the base's dX. Per column linear and microbatch: one all-gather forward; backward one
  all-gather (the LoRA term's saved input, kept as this rank's shard), one reduce-scatter, the all-reduce of
  dS.
- row-parallel: the LoRA term first (its all-reduce of S, m×r, is small and would otherwise queue on the
  communicator behind the base's reduce-scatters), then the base's GEMMs with their reduce-scatter (SP) or
  all-reduce. Under SP the full-sequence LoRA term goes into the base's function, which adds this rank's rows
  and hands it the all-gathered dY in backward: one all-gather of dY for base and LoRA (Megatron's path plus
  ``scatter_to_sequence_parallel_region`` gathers dY twice).

Where it does not apply the linear keeps Megatron's path: tp = 1, an FP8 base (its own GEMM), a trainable
base weight (dW), a column linear that gathers its output, a row linear whose input is not split, a call with
Megatron's extra arguments.
"""

from __future__ import annotations

import contextlib

from lorafusion.layers.fp8_base import is_fp8
from lorafusion.ops.tp_overlap import column_linear_overlapped, row_linear_overlapped

__all__ = ["tp_forward", "tp_path"]


def tp_path(linear, args=(), kwargs=None) -> int | None:
    """How ``linear``'s forward runs its TP collectives: None where this module's path does not apply
    (Megatron's forward, see the module docstring), 0 in line, n >= 1 overlapped in n nano-batches (its
    config's ``tp_overlap``)."""
    if args or kwargs or linear._tp()[0] == 1:
        return None
    if linear.weight is None or is_fp8(linear) or linear.weight.requires_grad:
        return None
    if getattr(linear, "gather_output", False) or not getattr(linear, "input_is_parallel", True):
        return None
    return max(0, int(getattr(linear.config, "tp_overlap", 0) or 0))


def tp_forward(linear, input_, largs, nano: int, shard_hooks=None):
    """(output, bias) of ``linear`` as Megatron's forward gives them, the base's collectives overlapped
    (``nano`` >= 1) or in line (0); ``largs``: its LoRA arguments (``LoRALinear._lora_args``) or None;
    ``shard_hooks(full, shard, group, tp)``: the saved-tensor hooks that keep the LoRA term's saved gathered
    input as this rank's sequence shard (SP)."""
    group = linear.tp_group
    sp, bias = linear.sequence_parallel, linear.bias
    add_bias = bias is not None and not linear.skip_bias_add
    if linear.s_comm_mode == "column":
        y, full = column_linear_overlapped(input_, linear.weight, group, nano, sequence_parallel=sp,
                                           keep_input=largs is not None)
        if add_bias:
            y = y + bias
        if largs is not None:
            x = full if sp else input_
            hooks = (shard_hooks(full, input_, group, linear._tp()[0]) if sp and shard_hooks
                     else contextlib.nullcontext())
            with hooks:
                y = y + linear._lora_delta(x, largs)
    else:
        delta = None if largs is None else linear._lora_delta(input_, largs)
        y = row_linear_overlapped(input_, linear.weight, group, nano, sequence_parallel=sp,
                                  delta=delta if sp else None)
        if delta is not None and not sp:
            y = y + delta
        if add_bias:
            y = y + bias
    return y, (bias if linear.skip_bias_add else None)
