"""FP8 frozen base for the LoRA linears (``model.base_precision: fp8``).

:func:`quantize_base` replaces every decoder LoRA linear's bf16 weight (qkv, proj, fc1, fc2; this rank's TP
shard, this stage's layers) by ``weight_fp8`` (float8_e4m3fn [n, k]) and ``weight_scale`` (float32 [n], one
per output channel), both non-persistent buffers, and frees the bf16 parameter (``weight`` becomes None):
the base is never checkpointed, so nothing of it is written. :func:`fp8_base_forward` is Megatron's
Column/RowParallelLinear forward (TP collectives, sequence parallelism, bias) around
:func:`lorafusion.ops.fp8_linear.fp8_linear` instead of the bf16 GEMM. The LoRA term is unchanged and sees the
bf16 X. The output layer and embeddings stay in the model dtype. Without TP, with the fused LoRA kernels,
:func:`fp8_fused_forward` runs base and LoRA term as one op (:mod:`lorafusion.ops.fp8_lora`).
"""

from __future__ import annotations

import torch

from lorafusion.ops.fp8_linear import check_fp8_device, fp8_linear, quantize_weight

BASE_PRECISIONS = ("bf16", "fp8")
# Decoder layers (the first ones of the model, global numbering) whose linears stay in the model dtype with an fp8
# base: the LoRA gradients are most sensitive to the first layers' rounding (docs/BENCHMARKS.md, FP8 quality).
BF16_LEADING_LAYERS = 0


def is_fp8(mod) -> bool:
    return getattr(mod, "weight_fp8", None) is not None


def quantize_linear(mod) -> None:
    """Quantize one LoRA linear's base weight in place and free the bf16 copy (idempotent)."""
    if is_fp8(mod):
        return
    w = mod.weight
    q, s = quantize_weight(w.data)
    mod.register_buffer("weight_fp8", q, persistent=False)
    mod.register_buffer("weight_scale", s, persistent=False)
    mod.base_dtype = w.dtype
    mod.weight = None  # Module.__setattr__ keeps the name registered as a (None) parameter


def layer_number(mod) -> int:
    """The global (1-based) decoder layer number of a LoRA linear (from its ``lora_key`` "<layer>.<kind>")."""
    return int(mod.lora_key.split(".", 1)[0])


def quantize_base(model, precision: str = "fp8", bf16_layers: int | None = None) -> int:
    """Put the frozen decoder linears of ``model`` (a stage or a list of chunks) in ``precision``;
    returns how many linears are FP8. "bf16" leaves the model as built. With "fp8" the linears of the first
    ``bf16_layers`` decoder layers of the whole model (None: :data:`BF16_LEADING_LAYERS`) stay as they are;
    called again with a smaller number it quantizes the rest (idempotent otherwise)."""
    from lorafusion.layers.inject import _chunks, _unwrap, lora_modules

    if precision not in BASE_PRECISIONS:
        raise ValueError(f"model.base_precision: expected one of {BASE_PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        return 0
    keep = BF16_LEADING_LAYERS if bf16_layers is None else int(bf16_layers)
    mods = [m for _, m in lora_modules(model) if layer_number(m) > keep]
    if mods:
        check_fp8_device(mods[0].weight_fp8.device if is_fp8(mods[0]) else mods[0].weight.device)
    for mod in mods:
        quantize_linear(mod)
    for chunk in _chunks(model):
        _unwrap(chunk).config.base_precision = precision  # a field of lorafusion.models.config.LoRAFusionConfig
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give the freed bf16 weights back (the allocator would reuse them anyway)
    return len(mods)


def base_weight_bytes(model) -> int:
    """Bytes of the decoder linears' base weights on this rank (FP8: the fp8 weights and their scales)."""
    from lorafusion.layers.inject import lora_modules

    total = 0
    for _, mod in lora_modules(model):
        for t in (mod.weight, getattr(mod, "weight_fp8", None), getattr(mod, "weight_scale", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def fp8_base_forward(mod, input_: torch.Tensor):
    """(output, output bias) of a Megatron Column/RowParallelLinear whose weight is FP8, with Megatron's TP and
    SP communication: column — all-gather the sequence (SP) or copy to the TP region (backward: reduce-scatter
    / all-reduce of dX), FP8 GEMM, optional output gather; row — FP8 GEMM on the in-dim shard, then
    reduce-scatter (SP) or all-reduce, bias after the reduction."""
    from megatron.core.tensor_parallel import mappings as M

    tp = mod._tp()[0]
    group = getattr(mod, "tp_group", None)
    w_q, w_s = mod.weight_fp8, mod.weight_scale
    if mod.s_comm_mode == "column":
        x = input_
        if mod.sequence_parallel:
            x = M.gather_from_sequence_parallel_region(input_, True, group=group)
        elif tp > 1:
            x = M.copy_to_tensor_model_parallel_region(input_, group=group)
        y = fp8_linear(x, w_q, w_s, None if mod.skip_bias_add else mod.bias)
        if mod.gather_output:
            y = M.gather_from_tensor_model_parallel_region(y, group=group)
        return y, (mod.bias if mod.skip_bias_add else None)
    x = input_ if mod.input_is_parallel else M.scatter_to_tensor_model_parallel_region(input_, group=group)
    y = fp8_linear(x, w_q, w_s)
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
    from lorafusion.ops.fp8_lora import fp8_multi_lora_linear

    routing, a, b, scaling, p, seeds, seed_table = largs
    bias = None if mod.skip_bias_add or mod.bias is None else mod.bias
    y = fp8_multi_lora_linear(input_, mod.weight_fp8, mod.weight_scale, bias, a, b, scaling, p, seeds, routing,
                              cache=mod.lora_ctx.tables, seed_table=seed_table)
    return y, (mod.bias if mod.skip_bias_add else None)
