"""LoRA compute entry points. Dispatch: Triton kernels on CUDA (``fused``), plain torch elsewhere.

Layers call :func:`multi_lora_delta`; the implementation is chosen by ``impl`` ("reference" | "fused"),
else by :func:`set_default_impl`, else automatically (fused when the input is on CUDA and the Triton
kernels import).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.ops.dropout import keep_mask, mix_seed, philox_uniform
from lorafusion.ops.reference import multi_lora_delta_reference
from lorafusion.ops.routing import Routing

__all__ = ["Routing", "multi_lora_delta", "multi_lora_linear", "set_default_impl", "get_default_impl", "keep_mask", "mix_seed",
           "philox_uniform"]

_IMPLS = ("reference", "fused")
_default_impl: str | None = None


def set_default_impl(impl: str | None) -> None:
    """Process-wide default: "reference", "fused" or None (automatic)."""
    global _default_impl
    if impl not in (None, *_IMPLS):
        raise ValueError(f"kernels: expected one of {_IMPLS} (or None for automatic), got {impl!r}")
    _default_impl = impl


def get_default_impl() -> str | None:
    return _default_impl


def _fused_available() -> bool:
    try:
        from lorafusion.ops import fused  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(x: torch.Tensor, impl: str | None = None) -> str:
    impl = impl or _default_impl
    if impl is None:
        return "fused" if x.is_cuda and _fused_available() else "reference"
    if impl not in _IMPLS:
        raise ValueError(f"kernels: expected one of {_IMPLS}, got {impl!r}")
    return impl


def multi_lora_delta(x: torch.Tensor, lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                     scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                     routing: Routing, *, k_offset: int = 0, k_total: int | None = None,
                     s_comm: str | None = None, tp_group=None, impl: str | None = None) -> torch.Tensor:
    """Σ_segments s_a · dropout_a(X_seg)·A_aᵀ·B_aᵀ for a packed batch ``x`` [..., k] → [..., n].

    Per adapter slot ``a``: ``lora_A[a]`` [r_a, k], ``lora_B[a]`` [n, r_a], ``scaling[a]``, ``dropout_p[a]``,
    ``seeds[a]`` (Philox seed of this call for that adapter). ``k_offset``/``k_total`` place a row-parallel
    input shard inside the full input width so masks equal the unsharded ones. ``s_comm``: tensor-parallel
    collective on S ("column" | "row" | None) over ``tp_group``.
    """
    if resolve_impl(x, impl) == "fused":
        from lorafusion.ops.fused import multi_lora_delta_fused

        return multi_lora_delta_fused(x, lora_A, lora_B, scaling, dropout_p, seeds, routing,
                                      k_offset=k_offset, k_total=k_total, s_comm=s_comm, tp_group=tp_group)
    return multi_lora_delta_reference(x, lora_A, lora_B, scaling, dropout_p, seeds, routing,
                                      k_offset=k_offset, k_total=k_total, s_comm=s_comm, tp_group=tp_group)


def multi_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor], scaling: Sequence[float],
                      dropout_p: Sequence[float], seeds: Sequence[int], routing: Routing, *,
                      impl: str | None = None) -> torch.Tensor:
    """Frozen base plus LoRA in one op, for a layer without tensor parallelism:
    ``Y = X·Wᵀ (+ bias) + Σ_segments s_a·dropout_a(X)·A_aᵀ·B_aᵀ``. The fused path does it in one GEMM."""
    if resolve_impl(x, impl) == "fused":
        from lorafusion.ops.fused import multi_lora_linear_fused

        return multi_lora_linear_fused(x, weight, bias, lora_A, lora_B, scaling, dropout_p, seeds, routing)
    y = torch.nn.functional.linear(x, weight, bias)
    return y + multi_lora_delta_reference(x, lora_A, lora_B, scaling, dropout_p, seeds, routing)
