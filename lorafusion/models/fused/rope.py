"""Non-interleaved RoPE for packed (thd) input without host synchronisation.

Megatron's ``_apply_rotary_pos_emb_thd`` calls ``.tolist()`` on ``cu_seqlens`` for every q and k of every
layer and splits the microbatch per sample. Here positions are derived on the device from ``cu_seqlens``
(position = token index − start of its sample, restarting per sample exactly as Megatron's
``freqs[:seqlen]`` per sample and as ``lorafusion.data.packing``'s ``position_ids``), cos/sin are gathered
once per microbatch from Megatron's frequency table (:class:`PackedRope`, cached on the ``cu_seqlens``
tensor) and each of q and k is rotated by one op.

Numerics equal Megatron's unfused ``_apply_rotary_pos_emb_bshd`` (= HF's ``apply_rotary_pos_emb``): cos and
sin are taken in fp32 from the same table, cast to the activation dtype, ``y = x·cos + rotate_half(x)·sin``.
``impl="torch"`` is that formula (bit-identical to Megatron) with a backward that saves nothing but the
shared cos/sin; ``impl="triton"`` a Triton kernel that evaluates it in fp32 and rounds once.
:func:`rope_reference` is the plain autograd formula.
"""

from __future__ import annotations

import torch

from lorafusion.ops.launch import Launcher
from lorafusion.models.fused import check_impl


def packed_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of every packed token within its sample (int64, on ``cu_seqlens``' device, no sync)."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(num_tokens, device=cu.device, dtype=torch.int64)
    seg = torch.searchsorted(cu[1:], t, right=True)
    return t - cu.gather(0, seg.clamp_max(cu.numel() - 1))


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin halves [T, D/2] (fp32) from Megatron's table ``freqs`` [S, 1, 1, D] (or [S, D],
    non-interleaved: ``cat(f, f)``) at ``positions`` (clamped to the table)."""
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    half = table.shape[-1] // 2
    f = table.index_select(0, positions.clamp(0, table.shape[0] - 1))[:, :half].float()
    return torch.cos(f), torch.sin(f)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D], ``cos``/``sin`` [T, D/2] → Megatron's / HF's rotation (cos/sin cast to x's dtype)."""
    c = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]
    s = torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]
    return x * c + _rotate_half(x) * s


class _RopeTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_reference(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        c = torch.cat((cos, cos), dim=-1).to(dy.dtype)[:, None, :]
        s = torch.cat((sin, sin), dim=-1).to(dy.dtype)[:, None, :]
        ds = dy * s
        d1, d2 = torch.chunk(ds, 2, dim=-1)
        return dy * c + torch.cat((d2, -d1), dim=-1), None, None


_KERNEL = None


def _rope_kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _rope_thd_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, x_st, x_sh, y_st, y_sh, c_st, n_heads,
                             HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             BACKWARD: tl.constexpr):
            # one program per token: all heads, both halves of the head dim
            t = tl.program_id(0).to(tl.int64)
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            mask = (h < n_heads) & (d < HALF)
            c = tl.load(cos_ptr + t * c_st + d, mask=d < HALF, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * c_st + d, mask=d < HALF, other=0.0).to(tl.float32)
            if BACKWARD:
                s = -s
            xp = x_ptr + t * x_st + h * x_sh + d
            x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
            yp = y_ptr + t * y_st + h * y_sh + d
            tl.store(yp, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(yp + HALF, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)

        _KERNEL = Launcher(_rope_thd_kernel)  # (repeat launches without JITFunction.run's work)
    return _KERNEL


def _rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    import triton

    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, dim = x.shape
    y = torch.empty((t, h, dim), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    half = dim // 2
    _rope_kernel().launch((t,), x, y, cos, sin, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                          cos.stride(0), h, HALF=half, BLOCK_H=triton.next_power_of_2(h),
                          BLOCK_D=triton.next_power_of_2(half), BACKWARD=backward)
    return y


class _RopeTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_triton(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_triton(dy, cos, sin, backward=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, impl: str = "triton") -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by per-token ``cos``/``sin`` halves [T, D/2] (cast to x's dtype first, as
    Megatron does)."""
    check_impl(impl)
    if (x.dim() != 3 or x.shape[-1] % 2 or cos.shape != (x.shape[0], x.shape[-1] // 2)
            or sin.shape != cos.shape):
        raise ValueError("rope: expected x [T, H, D] with even D and cos/sin [T, D/2], got x "
                         f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    return (_RopeTriton if impl == "triton" else _RopeTorch).apply(x, cos, sin)


class PackedRope:
    """cos/sin of one packed microbatch, built once and shared by every layer's q and k."""

    def __init__(self, freqs: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int):
        self.freqs = freqs
        self.num_tokens = num_tokens
        self.cos, self.sin = rope_cos_sin(freqs, packed_positions(cu_seqlens, num_tokens))
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype).contiguous(), self.sin.to(dtype).contiguous())
        return self._cast[dtype]

    @classmethod
    def for_microbatch(cls, freqs: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> "PackedRope":
        """The microbatch's cos/sin, cached on its ``cu_seqlens`` tensor (which lives exactly as long as the
        microbatch); rebuilt if the frequency table or token count differ."""
        cached = getattr(cu_seqlens, "_lorafusion_packed_rope", None)
        if cached is None or cached.freqs is not freqs or cached.num_tokens != num_tokens:
            cached = cls(freqs, cu_seqlens, num_tokens)
            cu_seqlens._lorafusion_packed_rope = cached
        return cached


def packed_rope(x: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor, *, impl: str = "triton"):
    """Megatron's ``apply_rotary_pos_emb(x, freqs, cu_seqlens=...)`` for thd ``x`` [T, H, D] (no CP, no
    interleave, full rotary dim) without host syncs."""
    pr = PackedRope.for_microbatch(freqs, cu_seqlens, x.shape[0])
    cos, sin = pr.cos_sin(x.dtype)
    return rope(x, cos, sin, impl=impl)


__all__ = ["rope", "rope_reference", "rope_cos_sin", "packed_positions", "packed_rope", "PackedRope"]
