"""``LoRAFusionConfig``: Megatron's ``TransformerConfig`` plus the knobs of our model, as declared fields.

Megatron-core passes one config object to every module it builds; our modules and patches read their
settings from it instead of from attributes set on Megatron objects afterwards (issue 26).
``config.timers`` is Megatron's own field (``ModelParallelConfig.timers``), the hook its schedules time
their stages through; the trainer sets it there.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

import torch

from lorafusion.core.arch import ModelArch


@dataclass
class LoRAFusionConfig(TransformerConfig):
    """A ``TransformerConfig`` built by :func:`lorafusion.models.spec.transformer_config`."""

    arch: ModelArch | None = None
    """The architecture the config was built from: export and import map names and shapes by it."""

    fused_ops: str = "off"
    """The ops around the LoRA layers: "off" (Megatron's local spec), "torch" or "triton" (the fused RMSNorm,
    SwiGLU, packed RoPE and linear cross-entropy of that implementation; :mod:`lorafusion.models.fused`)."""

    packed_rope_impl: str | None = None
    """Packed-sequence RoPE implementation ("torch" / "triton") used by the dispatcher that
    ``megatron_patches.apply_packed_rope_patch`` installs; None = Megatron's own RoPE."""

    base_precision: str = "bf16"
    """Precision of the frozen decoder linears: "bf16" as built, "fp8" once
    :func:`lorafusion.layers.fp8_base.quantize_base` has quantized them (it records it here)."""

    base_model: str | None = None
    """The HF model directory the base weights were loaded from (``build_model_from_hf`` records it): what
    exported PEFT adapters name as their ``base_model_name_or_path``."""

    rope_positions: torch.Tensor | None = None
    """Decoding with a KV cache only: the position of each packed row ([t] long), set per forward inside
    :func:`lorafusion.inference.kv_cache.decoding` and read by ``megatron_patches.apply_rope_positions_patch``'s
    RoPE; None (training, and outside ``decoding``): positions restart at every ``cu_seqlens`` boundary."""


__all__ = ["LoRAFusionConfig"]
