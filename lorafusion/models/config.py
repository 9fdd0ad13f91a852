"""``LoRAFusionConfig``: Megatron's ``TransformerConfig`` plus the knobs of our model, as declared fields.

Megatron-core passes one config object to every module it builds; our modules and patches read their
settings from it instead of from attributes set on Megatron objects afterwards. The config is complete when
the model is built (:func:`lorafusion.models.spec.transformer_config`) and nothing writes it afterwards:

- ``timers`` is Megatron's own field (``ModelParallelConfig.timers``), the hook its schedules time their
  stages through; ``build_model(timers=...)`` sets it to the runtime's object (which pauses itself while an
  evaluation runs) or leaves it None;
- the per-forward state of decoding (the rows' RoPE positions) lives in the KV cache
  (:mod:`lorafusion.inference.kv_cache`), never here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from lorafusion.core.arch import ModelArch
from lorafusion.core.precision import FP8_BF16_LEADING_LAYERS


@dataclass
class LoRAFusionConfig(TransformerConfig):
    """A ``TransformerConfig`` built by :func:`lorafusion.models.spec.transformer_config`."""

    arch: ModelArch | None = None
    """The architecture the config was built from: export and import map names and shapes by it, and the
    model's RoPE frequencies are computed from it (:meth:`ModelArch.inv_freq`)."""

    fused_ops: str = "off"
    """The ops around the LoRA layers: "off" (Megatron's local spec), "torch" or "triton" (the fused RMSNorm,
    SwiGLU, packed RoPE and linear cross-entropy of that implementation; :mod:`lorafusion.models.fused`)."""

    packed_rope_impl: str | None = None
    """Packed-sequence RoPE implementation ("torch" / "triton") used by the dispatcher that
    ``megatron_patches.apply_packed_rope_patch`` installs; None = Megatron's own RoPE."""

    base_precision: str = "bf16"
    """Precision of the frozen decoder linears ("bf16" or "fp8"): each LoRA linear reads it when it is built
    and, with "fp8" (past the first ``fp8_bf16_layers`` layers), keeps its base in FP8
    (:mod:`lorafusion.layers.fp8_base`)."""

    fp8_bf16_layers: int = FP8_BF16_LEADING_LAYERS
    """With ``base_precision`` "fp8": how many leading decoder layers of the whole model keep their linears in
    the model dtype (the memory model counts the same number: :mod:`lorafusion.core.precision`)."""

    tp_overlap: int = 0
    """Tensor-parallel collectives overlapped with compute (``parallelism.tp_overlap``): the number of
    nano-batches of rows of the all-reduces without sequence parallelism (:mod:`lorafusion.ops.tp_overlap`;
    with SP the nano-batches are the ranks' sequence shards); 0: off."""

    base_model: str | None = None
    """The HF model directory the base weights are loaded from (``build_model_from_hf`` gives it): what
    exported PEFT adapters name as their ``base_model_name_or_path``."""


__all__ = ["LoRAFusionConfig"]
