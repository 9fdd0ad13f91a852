"""The LoRA parallel linears' tensor-parallel forward: the frozen base with its TP collectives — overlapped
with compute (``parallelism.tp_overlap``; the model config's ``tp_overlap``: 0 = off, else on, with that many
nano-batches of rows for the all-reduces without sequence parallelism) or in line (off) — and the LoRA terms
sharing those collectives.

The frozen base runs through :mod:`lorafusion.ops.tp_overlap` (overlapped: each collective in flight while the
GEMM of rows that do not wait for it runs); the LoRA term of every adapter is computed in the same layer call
around it, on the same tensors as Megatron's path, so every adapter's output and gradients are the ones of
Megatron's path (:class:`lorafusion.layers.lora_linear.LoRALinear`), with fewer collectives, and none of the
LoRA term's own (no all-reduce of S or dS: :mod:`lorafusion.ops.comm`):

- column-parallel: the base returns its input along with its output — under SP the all-gathered one — and the
  LoRA term is computed on it: no second all-gather of the same rows (Megatron's path gathers once for the
  base and once more for the LoRA term). dS is left partial (this rank's output columns), so are the LoRA
  term's dX, which is added to the base's partial dX before its one reduce-scatter (SP) / all-reduce, and dA
  (summed over TP once per step). Per column linear and microbatch: one all-gather forward; backward one
  all-gather (the LoRA term's saved input, kept as this rank's shard), one reduce-scatter.
- row-parallel: the LoRA term first, from this rank's input columns: a partial S and s·S·Bᵀ, added to the
  base's partial output before its one reduce-scatter (SP) / all-reduce; in backward it gets the whole dY
  (under SP the all-gathered dY the base gathers anyway: one all-gather of dY for base and LoRA), so dS and
  dA are exact and dB (from this rank's S) is partial, summed over TP once per step.

Under SP the all-gather that rebuilds a column linear's saved input in backward is issued early: by the
backward of the row linear after it in forward (proj after qkv, fc2 after fc1), right after that one's
all-gather of dY, so it runs under the row linear's dX GEMM and what follows (attention's backward, SwiGLU's)
instead of in line when the LoRA term's backward needs it (``rebuild_saved``'s prefetch).

Where it does not apply the linear keeps Megatron's path: tp = 1, an FP8 base (its own GEMM; its LoRA term
rides on its collectives the same way, :func:`tp_lora`), a trainable base weight (dW), a column linear that
gathers its output, a row linear whose input is not split, a call with Megatron's extra arguments.
"""

from __future__ import annotations

import contextlib

from lorafusion.layers.fp8_base import is_fp8
from lorafusion.ops.comm import is_partial_grad, mark_partial_grad
from lorafusion.ops.tp_overlap import column_linear_overlapped, row_linear_overlapped

__all__ = ["partial_factors", "refuse_partial", "tp_forward", "tp_lora", "tp_path"]

# the prefetch of the LoRA term's saved input of the last column linear under SP (its all-gather in backward),
# handed to the next row linear, whose backward — before the column linear's — starts it under its own GEMMs
_PREFETCH: list = [None]


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


def partial_factors(linear):
    """The LoRA parameters of ``linear`` that are replicated over TP and whose gradient the TP path leaves
    partial: a column linear's A's, a row linear's B's (:mod:`lorafusion.ops.comm`)."""
    return (linear.lora_A if linear.s_comm_mode == "column" else linear.lora_B).values()


def refuse_partial(linear) -> None:
    """Before the LoRA term of ``linear`` runs on Megatron's path (its own collectives on S / dS, full
    gradients): a linear whose adapters took the TP path before (partial gradients, summed once per step)
    must not mix the two."""
    if linear._tp()[0] > 1 and any(is_partial_grad(p) for p in partial_factors(linear)):
        raise RuntimeError(f"internal: LoRA linear {linear.lora_key} ran its TP path before (gradients "
                           f"partial over TP) and now Megatron's path")


def tp_lora(linear, shard, largs, shard_hooks):
    """The LoRA term of ``linear`` as a function of the input its base GEMM sees, partial over TP (no
    collective of its own; its replicated factors marked), for a base that runs its own collectives and adds
    it before them (the FP8 base, :func:`lorafusion.layers.fp8_base.fp8_base_forward`). A column linear under
    SP gets the gathered input, whose saved copy is kept as this rank's ``shard`` (``shard_hooks`` as for
    :func:`tp_forward`)."""
    mark_partial_grad(partial_factors(linear))

    def lora(x):
        if linear.s_comm_mode != "column" or not linear.sequence_parallel:
            return linear._lora_delta(x, largs, partial=True)
        with shard_hooks(x, shard, linear.tp_group, linear._tp()[0]):
            return linear._lora_delta(x, largs, partial=True)

    return lora


def tp_forward(linear, input_, largs, nano: int, shard_hooks=None):
    """(output, bias) of ``linear`` as Megatron's forward gives them, the base's collectives overlapped
    (``nano`` >= 1) or in line (0); ``largs``: its LoRA arguments (``LoRALinear._lora_args``) or None;
    ``shard_hooks(full, shard, group, tp)``: the saved-tensor hooks that keep the LoRA term's saved gathered
    input as this rank's sequence shard (SP). The LoRA term has no collective of its own: see the module
    docstring; the replicated factors' gradients are partial (marked here, summed once per step)."""
    group = linear.tp_group
    sp, bias = linear.sequence_parallel, linear.bias
    add_bias = bias is not None and not linear.skip_bias_add
    if largs is not None:
        mark_partial_grad(partial_factors(linear))
    if linear.s_comm_mode == "column":
        y, x = column_linear_overlapped(input_, linear.weight, group, nano, sequence_parallel=sp,
                                        keep_input=largs is not None)
        if add_bias:
            y = y + bias
        _PREFETCH[0] = None
        if largs is not None:
            hooks = (shard_hooks(x, input_, group, linear._tp()[0]) if sp and shard_hooks
                     else contextlib.nullcontext())
            with hooks:
                y = y + linear._lora_delta(x, largs, partial=True)
            _PREFETCH[0] = getattr(hooks, "prefetch", None)
    else:
        delta = None if largs is None else linear._lora_delta(input_, largs, partial=True)
        then, _PREFETCH[0] = _PREFETCH[0], None
        y = row_linear_overlapped(input_, linear.weight, group, nano, sequence_parallel=sp, delta=delta,
                                  then=then)
        if add_bias:
            y = y + bias
    return y, (bias if linear.skip_bias_add else None)
