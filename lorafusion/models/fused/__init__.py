"""Fused model ops around the LoRA layers: one op per file, each with its torch reference beside it.

- :mod:`.linear_cross_entropy` — output projection + per-token cross-entropy, chunked, never keeping logits
- :mod:`.rms_norm` — RMSNorm in the activation dtype (saves input + rstd only)
- :mod:`.swiglu` — SwiGLU on Megatron's fused ``[gate; up]`` fc1 output (saves the fc1 output only)
- :mod:`.rope` — non-interleaved RoPE for packed (thd) input without host syncs

Every op takes ``impl``: ``"triton"`` (Triton / Liger-Kernel kernels; CUDA, or CPU under
``TRITON_INTERPRET=1``) or ``"torch"`` (plain torch, any device) — the words of :mod:`lorafusion.core.impls`,
which the LoRA ops take too. The model-level switch is
``build_model(fused_ops=...)``: ``"off"`` builds Megatron's stock modules exactly as before, ``"torch"`` or
``"triton"`` builds these ops with that implementation; the default (``None``) is ``"triton"`` on CUDA and
``"off"`` elsewhere.
"""

from __future__ import annotations

import torch

from lorafusion.core.impls import IMPLS, check_impl

FUSED_OPS_MODES = ("off", *IMPLS)


def resolve_fused_ops(mode: str | None, device: str | torch.device | None) -> str:
    """The fused-ops mode for a model built on ``device``: ``mode`` itself if given, else ``"triton"`` when
    the device is CUDA and ``"off"`` otherwise."""
    if mode is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return "triton" if dev.type == "cuda" else "off"
    if mode not in FUSED_OPS_MODES:
        raise ValueError(f"fused_ops: expected one of {FUSED_OPS_MODES} or None (automatic), got {mode!r}")
    return mode


__all__ = ["FUSED_OPS_MODES", "resolve_fused_ops", "check_impl"]
