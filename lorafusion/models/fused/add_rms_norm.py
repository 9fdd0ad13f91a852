"""Residual add fused into the RMSNorm that follows it: ``s = x + residual``, ``y = rms_norm(s)`` by one
kernel pair, with the same values as the add and :func:`~lorafusion.models.fused.rms_norm.rms_norm` run one
after the other (``impl="triton"``).

In a decoder layer the attention's residual sum ``s`` feeds both ``pre_mlp_layernorm`` and the MLP's residual
add. Unfused, that costs an add kernel in forward (read x and residual, write s; the norm reads s again) and
one in backward, where autograd sums the two gradients of ``s`` (the norm's dx and the residual's ds). Here
the forward kernel writes ``s`` and ``y`` in one pass, and the backward kernel adds ``ds`` to the norm's
``dx`` as it stores it: two activation-sized kernels fewer per layer and microbatch.

Rounding is the unfused one: ``s`` is rounded to the activation dtype before the norm reads it, and the
norm's ``dx`` is rounded to that dtype before ``ds`` is added (in fp32, rounded again) — what autograd's
accumulation of two tensors of that dtype computes.

:class:`AddNormBda` is the ``self_attn_bda`` of a :class:`lorafusion.models.fused.layer.FusedResidualLayer`:
Megatron's bias-dropout-add where it must be (a bias, dropout in training, other dtypes), else the fused op,
whose ``y`` it leaves on ``s`` for the layer's ``pre_mlp_layernorm`` (:meth:`RMSNorm.forward` takes it).
"""

from __future__ import annotations

import torch

from lorafusion.ops.launch import Launcher
from lorafusion.ops.saved import mark_rebuildable
from lorafusion.models.fused.rms_norm import _forward, _rows, _warps

_KERNELS = None
NORMED_ATTR = "_lorafusion_normed"  # on s: (the norm module, its output y), taken once by that norm


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _fwd(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, rstd_ptr, x_st, r_st, s_st, y_st, n_cols, eps,
                 BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * x_st + cols, mask=mask, other=0.0)
            r = tl.load(r_ptr + row * r_st + cols, mask=mask, other=0.0)
            s = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
            tl.store(s_ptr + row * s_st + cols, s, mask=mask)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            sf = s.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n_cols + eps)
            tl.store(rstd_ptr + row, rstd)
            y = (sf * rstd).to(x.dtype) * w
            tl.store(y_ptr + row * y_st + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

        @triton.jit
        def _bwd(dy_ptr, ds_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dy_st, ds_st, s_st, dx_st, n_cols,
                 BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            dy = tl.load(dy_ptr + row * dy_st + cols, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(s_ptr + row * s_st + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            ds = tl.load(ds_ptr + row * ds_st + cols, mask=mask, other=0.0)
            rstd = tl.load(rstd_ptr + row)
            m = dy * w
            dxn = rstd * m - rstd * rstd * rstd * s * (tl.sum(m * s, axis=0) / n_cols)
            dxn = dxn.to(ds.dtype).to(tl.float32)  # the norm's dx as stored, then autograd's sum
            dx = dxn + ds.to(tl.float32)
            tl.store(dx_ptr + row * dx_st + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)

        _KERNELS = (Launcher(_fwd), Launcher(_bwd))
    return _KERNELS


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        import triton

        x2, r2 = _rows(x), _rows(residual)
        n, h = x2.shape
        s = torch.empty((n, h), dtype=x.dtype, device=x.device)
        y = torch.empty((n, h), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(h)
        if n:
            _kernels()[0].launch((n,), x2, r2, weight, s, y, rstd, x2.stride(0), r2.stride(0), s.stride(0),
                                 y.stride(0), h, eps, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(s, weight, rstd)
        ctx.block = block
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, rstd = ctx.saved_tensors
        n, h = s.shape
        dy2, ds2 = _rows(dy), _rows(ds)
        dx = torch.empty((n, h), dtype=s.dtype, device=s.device)
        if n:
            _kernels()[1].launch((n,), dy2, ds2, s, weight, rstd, dx, dy2.stride(0), ds2.stride(0),
                                 s.stride(0), dx.stride(0), h, BLOCK=ctx.block, num_warps=_warps(ctx.block))
        dx = dx.view(ds.shape)
        return dx, dx, None, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(s, y)``: ``s = residual + x`` and ``y = rms_norm(s, weight, eps)`` (Triton; the weight frozen and
    of x's dtype, x and residual of one shape and dtype)."""
    if weight.requires_grad or weight.dtype != x.dtype or residual.dtype != x.dtype \
            or residual.shape != x.shape:
        raise ValueError("add_rms_norm: x and residual of one shape and dtype, a frozen weight of that dtype")
    w, eps = weight.contiguous(), float(eps)
    s, y = _AddRMSNorm.apply(x, residual, w, eps)
    return s, mark_rebuildable(y, lambda t: _forward(t, w, eps)[1].view(t.shape), s)


class AddNormBda:
    """Megatron's ``self_attn_bda`` (``bda(training, fused)(x_with_bias, residual, prob)``) fusing the add
    with ``norm`` (a Triton :class:`~lorafusion.models.fused.rms_norm.RMSNorm`) when it is a plain sum:
    no bias, no dropout (``prob`` 0 or not training), x and residual alike. A plain object, not a module:
    the norm stays the layer's submodule only."""

    def __init__(self, norm, fallback):
        self.norm, self.fallback = norm, fallback

    def __call__(self, training: bool, fused: bool):
        unfused = self.fallback(training, fused)

        def bda(x_with_bias, residual, prob):
            x, bias = x_with_bias
            w = self.norm.weight
            if (bias is not None or (training and prob > 0) or x.dtype != residual.dtype
                    or x.shape != residual.shape or w.dtype != x.dtype or w.requires_grad
                    or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
                return unfused(x_with_bias, residual, prob)
            s, y = add_rms_norm(x, residual, w, self.norm.eps)
            setattr(s, NORMED_ATTR, (self.norm, y))
            return s

        return bda


__all__ = ["add_rms_norm", "AddNormBda", "NORMED_ATTR"]
