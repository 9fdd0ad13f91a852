"""LoRA compute entry points. Dispatch: Triton kernels on CUDA (``fused``), plain torch elsewhere.

Layers call :func:`multi_lora_delta` / :func:`multi_lora_linear`; the implementation is the ``impl``
argument ("torch" | "triton", :mod:`lorafusion.core.impls`; the YAML's "reference" | "fused" mean the same),
or automatic when it is None (triton when the input is on CUDA and the Triton kernels import). There is no
process-wide default: the LoRA layers pass their model's choice.

``cache`` (a :class:`lorafusion.ops.tables.TableCache`) keeps device tables across calls of one
microbatch and adapter set; ``seed_table`` is ``seeds`` already on the device (one int64 per slot).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.core.impls import check_impl, spelled
from lorafusion.core.routing import Routing
from lorafusion.ops.reference import multi_lora_delta_reference, multi_lora_delta_torch

__all__ = ["multi_lora_delta", "multi_lora_linear", "resolve_impl"]


def _fused_available() -> bool:
    try:
        from lorafusion.ops import fused  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(x: torch.Tensor, impl: str | None = None) -> str:
    """"triton" or "torch" for an input like ``x`` (None: triton on CUDA when the kernels import)."""
    if impl is None:
        return "triton" if x.is_cuda and _fused_available() else "torch"
    return check_impl(spelled(impl), "kernels")


def multi_lora_delta(x: torch.Tensor, lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                     scaling: Sequence[float], dropout_p: Sequence[float], seeds: Sequence[int],
                     routing: Routing, *, k_offset: int = 0, k_total: int | None = None,
                     s_comm: str | None = None, tp_group=None, impl: str | None = None, cache=None,
                     seed_table: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_segments s_a · dropout_a(X_seg)·A_aᵀ·B_aᵀ for a packed batch ``x`` [..., k] → [..., n].

    Per adapter slot ``a``: ``lora_A[a]`` [r_a, k], ``lora_B[a]`` [n, r_a], ``scaling[a]``, ``dropout_p[a]``,
    ``seeds[a]`` (Philox seed of this call for that adapter). ``k_offset``/``k_total`` place a row-parallel
    input shard inside the full input width so masks equal the unsharded ones. ``s_comm``: tensor-parallel
    collective on S ("column" | "row" | None) over ``tp_group``.
    """
    if resolve_impl(x, impl) == "triton":
        from lorafusion.ops.fused import multi_lora_delta_fused

        return multi_lora_delta_fused(x, lora_A, lora_B, scaling, dropout_p, seeds, routing,
                                      k_offset=k_offset, k_total=k_total, s_comm=s_comm, tp_group=tp_group,
                                      cache=cache, seed_table=seed_table)
    ref = multi_lora_delta_torch if x.is_cuda else multi_lora_delta_reference
    return ref(x, lora_A, lora_B, scaling, dropout_p, seeds, routing, k_offset=k_offset, k_total=k_total,
               s_comm=s_comm, tp_group=tp_group, cache=cache, seed_table=seed_table)


def multi_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      lora_A: Sequence[torch.Tensor], lora_B: Sequence[torch.Tensor],
                      scaling: Sequence[float],
                      dropout_p: Sequence[float], seeds: Sequence[int], routing: Routing, *,
                      impl: str | None = None, cache=None, seed_table: torch.Tensor | None = None,
                      main_gemm: str | None = None) -> torch.Tensor:
    """Frozen base plus LoRA in one op, for a layer without tensor parallelism:
    ``Y = X·Wᵀ (+ bias) + Σ_segments s_a·dropout_a(X)·A_aᵀ·B_aᵀ``. The fused path does it in one GEMM."""
    if resolve_impl(x, impl) == "triton":
        from lorafusion.ops.fused import multi_lora_linear_fused

        return multi_lora_linear_fused(x, weight, bias, lora_A, lora_B, scaling, dropout_p, seeds, routing,
                                       cache=cache, seed_table=seed_table, main_gemm=main_gemm)
    y = torch.nn.functional.linear(x, weight, bias)
    return y + multi_lora_delta(x, lora_A, lora_B, scaling, dropout_p, seeds, routing, impl="torch",
                                cache=cache, seed_table=seed_table)
