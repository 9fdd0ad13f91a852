"""SwiGLU on Megatron's fused fc1 output ``y = [gate; up]`` (last dim 2F) → ``silu(gate) * up`` (F),
saving only ``y`` (the unfused ``silu(gate) * up`` also keeps silu's output, F more per token).

``impl="triton"``: Liger-Kernel's ``LigerFusedGateUpSiLUMulFunction`` (reads both halves of the one
buffer, no chunk copies). ``impl="torch"``: the same saved-tensor contract in torch (silu recomputed in
backward). Both mark their output as rebuildable from ``y`` by the same forward
(:func:`lorafusion.ops.saved.mark_rebuildable`): linear_fc2 saves its input for LoRA's dA, and keeps it as
that recipe instead (an elementwise pass in backward; ``y`` is kept here anyway).
:func:`swiglu_reference` is the plain formula (Megatron's unfused ``glu``). :class:`SwiGLU` is the activation
module Megatron's MLP calls on the whole fc1 output (``use_te_activation_func=True`` with
``MLPSubmodules.activation_func``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafusion.models.fused import check_impl
from lorafusion.ops.saved import mark_rebuildable


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


class _SwiGLUTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return swiglu_reference(y)

    @staticmethod
    def backward(ctx, dout):
        (y,) = ctx.saved_tensors
        gate, up = torch.chunk(y, 2, dim=-1)
        acc = torch.float64 if y.dtype == torch.float64 else torch.float32
        g, u, d = gate.to(acc), up.to(acc), dout.to(acc)
        sig = torch.sigmoid(g)
        silu = g * sig
        dgate = d * u * (sig * (1 + g * (1 - sig)))
        dup = d * silu
        return torch.cat([dgate, dup], dim=-1).to(y.dtype)


def swiglu(y: torch.Tensor, *, impl: str = "triton") -> torch.Tensor:
    check_impl(impl)
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim must be even ([gate; up]), got {y.shape[-1]}")
    if impl == "torch":
        return mark_rebuildable(_SwiGLUTorch.apply(y), swiglu_reference, y)
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    # 2-D in and out: Liger's backward returns the gradient flattened to [rows, 2F]
    y2 = y.reshape(-1, y.shape[-1])
    shape = (*y.shape[:-1], y.shape[-1] // 2)
    out = LigerFusedGateUpSiLUMulFunction.apply(y2, False).view(shape)
    return mark_rebuildable(out, lambda t: _liger_forward(t).view(shape), y2)


def _liger_forward(y2: torch.Tensor) -> torch.Tensor:
    """The forward kernel of ``LigerFusedGateUpSiLUMulFunction`` alone (what its forward returns)."""
    from liger_kernel.ops.swiglu import swiglu_fused_gate_up_forward

    return swiglu_fused_gate_up_forward(y2.contiguous())[1]


class SwiGLU(torch.nn.Module):
    """Megatron ``MLPSubmodules.activation_func`` module: fc1 output [..., 2F] → [..., F]."""

    def __init__(self, config=None, impl: str = "triton"):
        super().__init__()
        if config is not None and (config.activation_func is not F.silu or not config.gated_linear_unit):
            raise ValueError("lorafusion SwiGLU: needs activation_func=silu with gated_linear_unit=True")
        if config is not None and (config.activation_func_clamp_value is not None
                                   or config.glu_linear_offset):
            raise ValueError("lorafusion SwiGLU: activation clamping / glu_linear_offset are not supported")
        self.impl = check_impl(impl)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y, impl=self.impl)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"


__all__ = ["swiglu", "swiglu_reference", "SwiGLU"]
