"""The decoder as literal Megatron ``ModuleSpec`` trees (Megatron-core's ``gpt_layer_specs`` style).

A layer is Megatron's local spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``) with the four linears
LoRA-capable and the core attention for packed sequences; the variants are parameters: the norms (Megatron's
``WrappedTorchNorm`` or our :class:`~lorafusion.models.fused.rms_norm.RMSNorm` of an implementation) and the
activation (Megatron's ``config.activation_func`` or our fused
:class:`~lorafusion.models.fused.swiglu.SwiGLU`).
Each LoRA linear's spec carries in its params what the linear is wired with (:func:`lora_linear_spec`: its
kind, its global layer number, the model's LoRA context), so :func:`lora_block_spec` writes one layer spec per
decoder layer a stage builds. ``tests/models/test_layer_spec.py`` checks the tree equals Megatron's local spec
with those swaps.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from lorafusion.layers.lora_linear import LoRAColumnParallelLinear, LoRAContext, LoRARowParallelLinear
from lorafusion.models.attention import PackedDotProductAttention
from lorafusion.models.fused import check_impl, resolve_fused_ops
from lorafusion.models.fused.layer import FusedResidualLayer
from lorafusion.models.fused.rms_norm import RMSNorm
from lorafusion.models.fused.swiglu import SwiGLU


def norm_spec(impl: str | None):
    """The RMSNorm: Megatron's ``WrappedTorchNorm`` (None) or ours in implementation ``impl``."""
    return WrappedTorchNorm if impl is None else ModuleSpec(module=RMSNorm, params={"impl": check_impl(impl)})


def lora_linear_spec(kind: str, layer_number: int, lora_context: LoRAContext) -> ModuleSpec:
    """The LoRA linear ``kind`` (Megatron's name: linear_qkv and linear_fc1 column-parallel, linear_proj and
    linear_fc2 row-parallel) of global decoder layer ``layer_number`` (1-based), on the model's context."""
    module = LoRAColumnParallelLinear if kind in ("linear_qkv", "linear_fc1") else LoRARowParallelLinear
    return ModuleSpec(module=module, params={"lora_kind": kind, "layer_number": layer_number,
                                             "lora_context": lora_context})


def lora_layer_spec(transformer_impl: str = "local", fused_ops: str = "off", *,
                    sequence_parallel: bool = False, layer_number: int,
                    lora_context: LoRAContext) -> ModuleSpec:
    """LLaMA/Qwen2 decoder layer ``layer_number`` (global, 1-based) with LoRA linears on ``lora_context``.
    ``fused_ops`` "torch" / "triton": the fused RMSNorm and SwiGLU of that implementation ("triton" also fuses
    the attention residual add into pre_mlp_layernorm: :class:`FusedResidualLayer`); "off": Megatron's,
    except that the norms are our RMSNorm ("torch") under ``sequence_parallel`` (Megatron's
    ``WrappedTorchNorm`` refuses SP)."""
    if transformer_impl != "local":
        raise ValueError(f"model.transformer_impl: only 'local' is supported today, got {transformer_impl!r}")
    impl = None if resolve_fused_ops(fused_ops, None) == "off" else fused_ops
    norm = norm_spec(impl or ("torch" if sequence_parallel else None))

    def linear(kind: str) -> ModuleSpec:
        return lora_linear_spec(kind, layer_number, lora_context)

    return ModuleSpec(
        module=TransformerLayer if impl != "triton" else FusedResidualLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear("linear_qkv"),
                    core_attention=PackedDotProductAttention,
                    linear_proj=linear("linear_proj"),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=linear("linear_fc1"),
                    linear_fc2=linear("linear_fc2"),
                    # our SwiGLU on the whole fc1 output (config.use_te_activation_func,
                    # fused_config_overrides)
                    activation_func=(None if impl is None
                                     else ModuleSpec(module=SwiGLU, params={"impl": impl})),
                ),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def lora_block_spec(config, lora_context: LoRAContext, *, transformer_impl: str = "local",
                    fused_ops: str = "off", sequence_parallel: bool = False,
                    vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder of this pipeline stage (model chunk ``vp_stage`` under virtual pipeline): one
    :func:`lora_layer_spec` per layer it builds, numbered as Megatron numbers them (its offset for this
    stage), and the final norm (Megatron's default, or our RMSNorm as for the layers' norms)."""
    offset = get_transformer_layer_offset(config, vp_stage)
    layers = [lora_layer_spec(transformer_impl, fused_ops, sequence_parallel=sequence_parallel,
                              layer_number=offset + i + 1, lora_context=lora_context)
              for i in range(get_num_layers_to_build(config, vp_stage))]
    impl = None if resolve_fused_ops(fused_ops, None) == "off" else fused_ops
    norm_impl = impl or ("torch" if sequence_parallel else None)
    return TransformerBlockSubmodules(layer_specs=layers,
                                      layer_norm=LayerNormImpl if norm_impl is None else norm_spec(norm_impl))


__all__ = ["lora_block_spec", "lora_layer_spec", "lora_linear_spec", "norm_spec"]
