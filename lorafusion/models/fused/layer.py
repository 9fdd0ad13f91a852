"""The decoder layer of the fused ops: Megatron's ``TransformerLayer`` whose attention residual add is fused
into ``pre_mlp_layernorm`` (:mod:`lorafusion.models.fused.add_rms_norm`)."""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer

from lorafusion.models.fused.add_rms_norm import AddNormBda
from lorafusion.models.fused.rms_norm import RMSNorm


class FusedResidualLayer(TransformerLayer):
    """``TransformerLayer`` with ``self_attn_bda`` = :class:`AddNormBda` of its ``pre_mlp_layernorm`` when
    that is our Triton RMSNorm and the layer runs the norm plainly on the bda's output (no recomputed or
    offloaded norm, no cross-attention between them); otherwise exactly Megatron's layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        norm, cfg = self.pre_mlp_layernorm, self.config
        plain = (not getattr(self, "recompute_pre_mlp_layernorm", False)
                 and not getattr(self, "offload_mlp_norm", False)
                 and not getattr(self, "offload_attn_norm", False)
                 and not getattr(cfg, "inference_fuse_tp_communication", False)
                 and type(self.cross_attention).__name__ == "IdentityOp")
        if isinstance(norm, RMSNorm) and norm.impl == "triton" and plain:
            self.self_attn_bda = AddNormBda(norm, self.self_attn_bda)


__all__ = ["FusedResidualLayer"]
