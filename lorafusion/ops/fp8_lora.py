"""FP8 frozen base plus the multi-adapter LoRA term in one autograd op (``model.base_precision: fp8``, no TP).

``Y = X·Wᵀ (+bias) + Σ_seg s·dropout(X_seg)·A_aᵀ·B_aᵀ`` with W stored as (W_q float8_e4m3fn [n, k], s_w [n])
(:mod:`lorafusion.ops.fp8_linear`). Against the split form ``fp8_linear(X) + multi_lora_delta(X)`` it saves
two passes over Y in forward and two over dX in backward, and one activation-sized allocation each way:

- forward: the shrink kernel (S = drop(X)·Aᵀ/(1-p)), X quantized per row, ``Y = scaled_mm(X_q, W_q)``, then
  the expand kernel adds ``s·S·Bᵀ`` (and the bias) into Y in place (``lora_gemm(..., accumulate=True)``),
  instead of writing the low-rank term to its own tensor and adding the two;
- backward: one pass over dY for dS and dB; ``dX = (dY·diag(s_w))_q·W_q`` by the FP8 GEMM; then one pass adds
  keep⊙(dS·A)/(1-p) into that dX in place and produces dA with the same mask (the bf16 path's "cublas"
  order), instead of autograd summing a separate low-rank dX. No dW (W is not a parameter).

The LoRA path sees the bf16 X, as in the bf16 base. Saved for backward: X, S, A_cat, Bt; the weight
(:class:`~lorafusion.ops.fp8_linear.Fp8Weight`: the model's buffers and their GEMM forms, made once per weight
by the layer) stays on ctx. :func:`fp8_multi_lora_linear_reference` is the split form in torch (the ground
truth of tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.core.routing import Routing
from lorafusion.ops import fp8_linear as F
from lorafusion.ops.fp8_linear import Fp8Weight, fp8_input_grad, fp8_linear, fp8_matmul

__all__ = ["fp8_multi_lora_linear", "fp8_multi_lora_linear_reference"]


class _Fp8MultiLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w: Fp8Weight, bias, plan, grad_dtype, *params):
        from lorafusion.kernels import fused_multi_lora as K
        from lorafusion.ops.fused import _cat_A, _cat_Bt

        ns = plan.n_slots
        st = plan.st
        A_cat, Bt = _cat_A(params[:ns], x2d.dtype), _cat_Bt(params[ns:], x2d.dtype)  # Bt.t() is B_cat
        S = K.lora_shrink(x2d, A_cat, st, plan.routing, plan.row_ids, k_total=plan.k_total, cache=plan.cache)
        y = fp8_matmul(x2d, w)
        K.lora_gemm(None, None, bias, S, Bt, st.scale, st, plan.routing, n=plan.n, out=y, accumulate=True,
                    cache=plan.cache)
        ctx.plan, ctx.grad_dtype, ctx.has_bias, ctx.w = plan, grad_dtype, bias is not None, w
        ctx.dtypes = [p.dtype for p in params]  # the adapters are not saved: backward reads none of them
        ctx.save_for_backward(x2d, S, A_cat, Bt)
        return y

    @staticmethod
    def backward(ctx, dy):
        from lorafusion.kernels import fused_multi_lora as K
        from lorafusion.ops.fused import _grads

        plan = ctx.plan
        st = plan.st
        x2d, S, A_cat, Bt = ctx.saved_tensors
        dtypes = ctx.dtypes
        ns = plan.n_slots
        need_x, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_da, need_db = any(ctx.needs_input_grad[5:5 + ns]), any(ctx.needs_input_grad[5 + ns:])
        if dy.dtype != x2d.dtype:
            dy = dy.to(x2d.dtype)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        dS, dB = K.lora_ds_db(dy, None, S, st, plan.routing, need_db=need_db, cache=plan.cache, Bt=Bt)
        dx, dA = None, [None] * ns
        if need_x:
            dx = fp8_input_grad(dy, ctx.w, ctx.grad_dtype)  # dy is in x's dtype
            dx, dA = K.lora_da_dx(x2d, dS, A_cat, dx, st, plan.routing, plan.row_ids, k_total=plan.k_total,
                                  need_da=need_da, cache=plan.cache)
        elif need_da:
            dA = K.lora_da(x2d, dS, st, plan.routing, plan.row_ids, k_total=plan.k_total, cache=plan.cache)
        dbias = dy.sum(0) if (need_b and ctx.has_bias) else None
        if not need_db:
            dB = [None] * ns
        return (dx, None, dbias, None, None, *_grads(dA, dtypes[:ns]), *_grads(dB, dtypes[ns:]))


def fp8_multi_lora_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None,
                          lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                          scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                          routing: Routing, *, cache=None, seed_table: torch.Tensor | None = None,
                          grad_dtype: torch.dtype | None = None,
                          form: Fp8Weight | None = None) -> torch.Tensor:
    """FP8 base plus LoRA through the Triton LoRA kernels (CUDA, or Triton's interpreter on CPU).
    Shapes as :func:`lorafusion.ops.multi_lora_linear`, with the weight given as (W_q [n, k], s_w [n]);
    ``form``: their :class:`~lorafusion.ops.fp8_linear.Fp8Weight` if the caller keeps one (else one is made
    for the call)."""
    from lorafusion.ops.fused import _Plan

    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if w_q.shape[1] != x2d.shape[1] or lora_B[0].shape[0] != w_q.shape[0]:
        raise ValueError(f"weight {tuple(w_q.shape)} / lora_B {tuple(lora_B[0].shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if x2d.is_cuda and x2d.dtype != torch.bfloat16:
        raise ValueError(f"fp8_multi_lora_linear: CUDA row-wise FP8 GEMMs write bfloat16; got {x.dtype}")
    plan = _Plan(x2d, lora_A, lora_B, scaling, dropout_p, seeds, routing, cache=cache, seed_table=seed_table)
    w = form if form is not None else Fp8Weight(w_q, w_scale)
    y = _Fp8MultiLoRALinear.apply(x2d, w, bias, plan, grad_dtype or F.GRAD_DTYPE, *lora_A, *lora_B)
    return y.reshape(*lead, y.shape[-1])


def fp8_multi_lora_linear_reference(x, w_q, w_scale, bias, lora_A, lora_B, scaling, dropout_p, seeds, routing,
                                    *, grad_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The split form in torch: ``fp8_linear(X) (+bias) + multi_lora_delta_reference(X)``."""
    from lorafusion.ops.reference import multi_lora_delta_reference

    y = fp8_linear(x, w_q, w_scale, bias, grad_dtype=grad_dtype)
    return y + multi_lora_delta_reference(x, lora_A, lora_B, scaling, dropout_p, seeds, routing)
