"""Packed (thd) causal attention on cuDNN's fused flash kernels, forward and backward.

The samples of a packed microbatch lie back to back in ``q`` [T, H, D], ``k``/``v`` [T, G, D] (G divides H,
grouped-query attention without repeating k/v); ``cu_seqlens`` [N+1] (int32, on the device) bounds them.
Each sample attends causally to itself only, as :func:`lorafusion.models.attention.varlen_attention_reference`
(the exact per-sample reference) and FlashAttention-2's varlen kernel do.

It calls ATen's ``_cudnn_attention_forward`` / ``_cudnn_attention_backward`` with cumulative sequence
lengths (the ragged-offset path torch uses for nested jagged tensors). torch's own ``varlen_attn`` has this
branch switched off (torch 2.11), and its backward passes the arguments in the wrong order, so the autograd
Function is ours. Inputs are made contiguous (cuDNN's ragged offsets count whole [H, D] rows); the log-sum-exp
cuDNN returns is kept as it comes and handed back to its backward.

:func:`cudnn_varlen_available` says whether the op may be tried here (CUDA, 16-bit, cuDNN present); a
failure at run time is the caller's to handle (:func:`lorafusion.models.attention.varlen_attention` falls back
to FlashAttention with a warning).
"""

from __future__ import annotations

import torch

__all__ = ["cudnn_varlen_attention", "cudnn_varlen_available"]


def cudnn_varlen_available(q: torch.Tensor) -> bool:
    """CUDA, fp16/bf16, head dim a multiple of 8 up to 128, cuDNN 9 loaded, the ATen ops present."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128):
        return False
    if not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        return False
    try:
        return torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
    except RuntimeError:
        return False


class _CudnnVarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        res = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            True,  # compute_log_sumexp: the backward needs it
            0.0, True, False, scale=scale)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, ctx.max_seqlen, ctx.max_seqlen,
            0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def cudnn_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, G, D] → [T, H, D]: causal attention within each [cu[i], cu[i+1]) sample.

    ``max_seqlen`` is an upper bound of the samples' lengths (a larger one is correct, only less tight)."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"cudnn_varlen_attention: q {tuple(q.shape)} needs k/v [T, G, D] with G dividing H, "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return _CudnnVarlenAttention.apply(q, k, v, cu, int(max_seqlen), float(scale))
