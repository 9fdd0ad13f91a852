"""The decoder layer as one literal Megatron ``ModuleSpec`` tree (Megatron-core's ``gpt_layer_specs`` style).

Megatron's local spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``) with the four linears LoRA-capable
and the core attention for packed sequences; the variants are parameters: the norms (Megatron's
``WrappedTorchNorm`` or our :class:`~lorafusion.models.fused.rms_norm.RMSNorm` of an implementation) and the
activation (Megatron's ``config.activation_func`` or our fused :class:`~lorafusion.models.fused.swiglu.SwiGLU`).
``tests/models/test_layer_spec.py`` checks the tree equals Megatron's local spec with those swaps.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from lorafusion.layers.lora_linear import LoRAColumnParallelLinear, LoRARowParallelLinear
from lorafusion.models.attention import PackedDotProductAttention
from lorafusion.models.fused import check_impl, resolve_fused_ops
from lorafusion.models.fused.rms_norm import RMSNorm
from lorafusion.models.fused.swiglu import SwiGLU


def norm_spec(impl: str | None):
    """The RMSNorm: Megatron's ``WrappedTorchNorm`` (None) or ours in implementation ``impl``."""
    return WrappedTorchNorm if impl is None else ModuleSpec(module=RMSNorm, params={"impl": check_impl(impl)})


def lora_layer_spec(transformer_impl: str = "local", fused_ops: str = "off", *,
                    sequence_parallel: bool = False) -> ModuleSpec:
    """One LLaMA/Qwen2 decoder layer with LoRA-capable linears. ``fused_ops`` "torch" / "triton": the fused
    RMSNorm and SwiGLU of that implementation; "off": Megatron's, except that the norms are our RMSNorm
    ("torch") under ``sequence_parallel`` (Megatron's ``WrappedTorchNorm`` refuses SP)."""
    if transformer_impl != "local":
        raise ValueError(f"model.transformer_impl: only 'local' is supported today, got {transformer_impl!r}")
    impl = None if resolve_fused_ops(fused_ops, None) == "off" else fused_ops
    norm = norm_spec(impl or ("torch" if sequence_parallel else None))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=LoRAColumnParallelLinear,
                    core_attention=PackedDotProductAttention,
                    linear_proj=LoRARowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=LoRAColumnParallelLinear,
                    linear_fc2=LoRARowParallelLinear,
                    # our SwiGLU on the whole fc1 output (config.use_te_activation_func, fused_config_overrides)
                    activation_func=None if impl is None else ModuleSpec(module=SwiGLU, params={"impl": impl}),
                ),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


__all__ = ["lora_layer_spec", "norm_spec"]
