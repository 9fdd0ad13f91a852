"""FP8 frozen base for the LoRA linears (``model.base_precision: fp8``).

A LoRA linear learns its base precision when it is built (:func:`base_precision_of`: the config's
``base_precision``, except the first ``fp8_bf16_layers`` decoder layers of the whole model, which keep the
model dtype). An FP8 linear's constructor calls :func:`init_fp8_storage`: its base is ``weight_fp8``
(float8_e4m3fn [n, k], this rank's TP shard) and ``weight_scale`` (float32 [n], one per output channel),
both non-persistent buffers, and it has no bf16 ``weight`` (None): the base is never checkpointed, and no
bf16 copy of an FP8 layer is ever held. Its weights arrive like any other base tensor, through
:func:`write_base_tensor` (random init, HF import), which quantizes them once.

:func:`fp8_base_forward` is Megatron's Column/RowParallelLinear forward (TP collectives, sequence parallelism,
bias) around :func:`lorafusion.ops.fp8_linear.fp8_linear` instead of the bf16 GEMM. The LoRA term is unchanged
and sees the bf16 X. The output layer and embeddings stay in the model dtype. Without TP, with the fused LoRA
kernels, :func:`fp8_fused_forward` runs base and LoRA term as one op (:mod:`lorafusion.ops.fp8_lora`).

Both forwards take the weight as the linear's :class:`~lorafusion.ops.fp8_linear.Fp8Weight`
(:func:`weight_form`): the GEMM operand forms made once and kept on the linear (a plain attribute: not a
buffer, never saved), remade when :func:`write_base_tensor` rewrites the weight, or when the buffers are
replaced (``module.to``) or written in place by anything else.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import mappings as M

from lorafusion.core.precision import BASE_PRECISIONS, FP8_BF16_LEADING_LAYERS
from lorafusion.ops.fp8_linear import E4M3, Fp8Weight, check_fp8_device, fp8_linear, quantize_weight
from lorafusion.ops import fp8_lora

# The first decoder layers of the whole model (global numbering) whose linears stay in the model dtype with an
# fp8 base (lorafusion.core.precision; the memory model counts the same number)
BF16_LEADING_LAYERS = FP8_BF16_LEADING_LAYERS
# Keep each FP8 weight's transpose (the input gradient's operand) instead of making it in every backward: one
# launch and a pass over W_q less per linear backward, for one more byte per weight (the FP8 base's whole
# saving over bf16 weights; the memory model does not count it). Off.
KEEP_TRANSPOSED = False
_FORM = "_fp8_form"


def base_precision_of(config, layer_number: int) -> str:
    """The precision of a decoder linear of global layer ``layer_number`` (1-based) built on ``config``
    (``lorafusion.models.config.LoRAFusionConfig``: ``base_precision``, ``fp8_bf16_layers``)."""
    precision = getattr(config, "base_precision", "bf16")
    if precision not in BASE_PRECISIONS:
        raise ValueError(f"model.base_precision: expected one of {BASE_PRECISIONS}, got {precision!r}")
    keep = getattr(config, "fp8_bf16_layers", BF16_LEADING_LAYERS)
    return "fp8" if precision == "fp8" and layer_number > keep else "bf16"


def is_fp8(mod) -> bool:
    return getattr(mod, "weight_fp8", None) is not None


def init_fp8_storage(mod) -> None:
    """In an FP8 linear's constructor: Megatron's bf16 weight parameter (just allocated, not yet initialised)
    becomes the FP8 buffers, filled when the weights are written (:func:`write_base_tensor`)."""
    w = mod.weight
    mod.register_buffer("weight_fp8", torch.zeros(w.shape, dtype=E4M3, device=w.device), persistent=False)
    mod.register_buffer("weight_scale", torch.ones(w.shape[0], dtype=torch.float32, device=w.device),
                        persistent=False)
    mod.base_dtype = w.dtype
    mod.register_parameter("weight", None)


def drop_fp8_storage(mod, weight: torch.nn.Parameter) -> None:
    """Undo :func:`init_fp8_storage`: the FP8 buffers and their weight form go, ``weight`` comes back."""
    del mod._buffers["weight_fp8"], mod._buffers["weight_scale"]
    mod.__dict__.pop(_FORM, None)
    mod.weight = weight


def base_tensor_like(mod, attr: str) -> torch.Tensor:
    """The tensor that holds ``mod``'s base tensor ``attr`` (an FP8 linear's weight: its ``weight_fp8``, whose
    shape and device the bf16 weight would have)."""
    return mod.weight_fp8 if attr == "weight" and is_fp8(mod) else getattr(mod, attr)


def write_base_tensor(mod, attr: str, value: torch.Tensor) -> None:
    """Write this rank's part of base tensor ``attr`` of ``mod`` (a frozen weight, bias or norm). An FP8
    linear's weight is cast to the model dtype on its device and quantized (per output channel) there."""
    if attr == "weight" and is_fp8(mod):
        check_fp8_device(mod.weight_fp8.device)
        q, s = quantize_weight(value.to(device=mod.weight_fp8.device, dtype=mod.base_dtype))
        mod.weight_fp8.copy_(q)
        mod.weight_scale.copy_(s)
        mod.__dict__.pop(_FORM, None)
        return
    getattr(mod, attr).copy_(value)


def weight_form(mod) -> Fp8Weight:
    """``mod``'s FP8 weight with its GEMM forms (:class:`~lorafusion.ops.fp8_linear.Fp8Weight`), made on the
    first call and kept while it describes the current buffers."""
    w_q, w_s = mod.weight_fp8, mod.weight_scale
    form = mod.__dict__.get(_FORM)
    if form is None or not form.fresh(w_q, w_s):
        form = Fp8Weight(w_q, w_s, transposed=KEEP_TRANSPOSED)
        mod.__dict__[_FORM] = form
    return form


def fp8_base_forward(mod, input_: torch.Tensor, lora=None):
    """(output, output bias) of a Megatron Column/RowParallelLinear whose weight is FP8, with Megatron's TP
    and SP communication: column — all-gather the sequence (SP) or copy to the TP region (backward:
    reduce-scatter / all-reduce of dX), FP8 GEMM, optional output gather; row — FP8 GEMM on the in-dim shard,
    then reduce-scatter (SP) or all-reduce, bias after the reduction. ``lora(x)``: a term of the input the
    GEMM sees, partial over TP as the GEMM's (the LoRA term, :mod:`lorafusion.ops.comm`), added to the GEMM's
    output before any collective: it shares the base's (one all-gather of X; dX summed by the base's
    reduction; a row linear's term summed by its reduce-scatter / all-reduce)."""
    tp = mod._tp()[0]
    group = getattr(mod, "tp_group", None)
    w = weight_form(mod)
    if mod.s_comm_mode == "column":
        x = input_
        if mod.sequence_parallel:
            x = M.gather_from_sequence_parallel_region(input_, True, group=group)
        elif tp > 1:
            x = M.copy_to_tensor_model_parallel_region(input_, group=group)
        y = fp8_linear(x, w.q, w.scale, None if mod.skip_bias_add else mod.bias, form=w)
        if lora is not None:
            y = y + lora(x)
        if mod.gather_output:
            y = M.gather_from_tensor_model_parallel_region(y, group=group)
        return y, (mod.bias if mod.skip_bias_add else None)
    x = input_ if mod.input_is_parallel else M.scatter_to_tensor_model_parallel_region(input_, group=group)
    y = fp8_linear(x, w.q, w.scale, form=w)
    if lora is not None:
        y = y + lora(x)
    if mod.sequence_parallel:
        y = M.reduce_scatter_to_sequence_parallel_region(y, group=group)
    elif tp > 1:
        y = M.reduce_from_tensor_model_parallel_region(y, group=group)
    if mod.skip_bias_add:
        return y, mod.bias
    return (y + mod.bias if mod.bias is not None else y), None


def fp8_fused_forward(mod, input_: torch.Tensor, largs):
    """(output, output bias) of an FP8 LoRA linear without TP: the FP8 base GEMM and the LoRA term in one op
    (:func:`lorafusion.ops.fp8_lora.fp8_multi_lora_linear`; ``largs`` = the layer's ``_lora_args``)."""
    routing, a, b, scaling, p, seeds, seed_table = largs
    bias = None if mod.skip_bias_add or mod.bias is None else mod.bias
    w = weight_form(mod)
    y = fp8_lora.fp8_multi_lora_linear(input_, w.q, w.scale, bias, a, b, scaling, p, seeds, routing,
                                       cache=mod.lora_ctx.tables, seed_table=seed_table, form=w)
    return y, (mod.bias if mod.skip_bias_add else None)
