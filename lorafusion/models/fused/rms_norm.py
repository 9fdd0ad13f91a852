"""RMSNorm in the activation dtype, saving only the input and the per-row rstd.

LLaMA / HF casting: ``rstd = rsqrt(mean(x²) + eps)`` in fp32, ``y = weight * (x · rstd).to(x.dtype)``.
The weight lives in the model's params dtype (HF checkpoints store it in bf16), so input and weight
dtypes match and no fp32 copies of the activations are saved.

``impl="triton"``: a row-per-program Triton kernel pair with Liger-Kernel's "llama" casting (Liger's own
``LigerRMSNormFunction`` calls ``eps.to(...)`` on a scalar argument, which Triton's CPU interpreter cannot
run, so it could not be tested here); no dW (the weight is frozen). ``impl="torch"``:
``torch.nn.functional.rms_norm`` with the weight in the input's dtype (torch's fused kernel on CUDA; for fp32
exactly what ``torch.nn.RMSNorm`` computes). :func:`rms_norm_reference` is the HF formula (tests and float64
ground truth). :class:`RMSNorm` is the Megatron norm module.

Both implementations mark their output as rebuildable from ``x`` by the same forward
(:func:`lorafusion.ops.saved.mark_rebuildable`): linear_qkv and linear_fc1 save their input for LoRA's dA,
and keep it as that recipe instead (one norm kernel in backward; the Triton backward keeps ``x`` anyway — the
torch one on CPU keeps fp32 copies instead, so there the recipe keeps ``x`` in place of the output, as many
bytes in a 2-byte dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafusion.ops.launch import Launcher
from lorafusion.models.fused import check_impl
from lorafusion.ops.saved import mark_rebuildable


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm``: statistics in fp32 (fp64 stays fp64), weight applied in x's dtype."""
    xf = x if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * y.to(x.dtype)


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, x_st, y_st, n_cols, eps, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * x_st + cols, mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
            tl.store(rstd_ptr + row, rstd)
            y = (xf * rstd).to(x.dtype) * w
            tl.store(y_ptr + row * y_st + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

        @triton.jit
        def _bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dy_st, x_st, dx_st, n_cols, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            dy = tl.load(dy_ptr + row * dy_st + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * x_st + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            m = dy * w
            dx = rstd * m - rstd * rstd * rstd * x * (tl.sum(m * x, axis=0) / n_cols)
            tl.store(dx_ptr + row * dx_st + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)

        _KERNELS = (Launcher(_fwd), Launcher(_bwd))  # (repeat launches without JITFunction.run's work)
    return _KERNELS


def _warps(block: int) -> int:
    """Warps of a row kernel over ``block`` columns (the norm's and the fused add-and-norm's)."""
    return 8 if block >= 4096 else 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x as rows, y [rows, h], rstd [rows] fp32, the kernels' block) by the forward kernel."""
    import triton

    x2 = _rows(x)
    n, h = x2.shape
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(h)
    if n:
        _kernels()[0].launch((n,), x2, weight, y, rstd, x2.stride(0), y.stride(0), h, eps, BLOCK=block,
                             num_warps=_warps(block))
    return x2, y, rstd, block


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2, y, rstd, block = _forward(x, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.block = block
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = _rows(dy)
        n, h = x2.shape
        dx = torch.empty((n, h), dtype=x2.dtype, device=x2.device)
        if n:
            _kernels()[1].launch((n,), dy2, x2, weight, rstd, dx, dy2.stride(0), x2.stride(0), dx.stride(0),
                                 h, BLOCK=ctx.block, num_warps=_warps(ctx.block))
        return dx.view(dy.shape), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "triton") -> torch.Tensor:
    """RMSNorm over the last dim; differentiable with respect to ``x`` (the weight is frozen)."""
    check_impl(impl)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if impl == "torch":
        shape = (x.shape[-1],)
        y = F.rms_norm(x, shape, weight, eps)
        if weight.requires_grad:  # a trained weight: not rebuilt (the recipe would close over it)
            return y
        return mark_rebuildable(y, lambda t: F.rms_norm(t, shape, weight, eps), x)
    if weight.requires_grad:
        raise ValueError("rms_norm(impl='triton'): the weight must be frozen (no dW is computed)")
    w, eps = weight.contiguous(), float(eps)
    y = _RMSNormTriton.apply(x, w, eps)
    return mark_rebuildable(y, lambda t: _forward(t, w, eps)[1].view(t.shape), x)


class RMSNorm(torch.nn.Module):
    """Megatron norm module (same constructor as ``WrappedTorchNorm``) with its weight in
    ``config.params_dtype``; parameter name ``weight`` as torch's, so state dicts are unchanged."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm", impl: str = "triton"):
        super().__init__()
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("lorafusion RMSNorm: only normalization='RMSNorm' without zero-centered gamma")
        # Sequence parallelism needs nothing here: the norm is per row and its weight is frozen (no dW to
        # all-reduce over the TP group, which is what Megatron's SP norms add).
        self.impl = check_impl(impl)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        done = x.__dict__.pop("_lorafusion_normed", None)  # computed with the residual add that made x
        if done is not None and done[0] is self:
            return done[1]
        return rms_norm(x, self.weight, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"


__all__ = ["rms_norm", "rms_norm_reference", "RMSNorm"]
