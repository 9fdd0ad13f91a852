"""The literal layer spec (models/layer_spec.py) equals Megatron's local spec with our swaps, for every
variant; each LoRA linear's spec carries its wiring (kind, global layer number, the model's LoRA context),
which the built linears hold."""

import copy

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from lorafusion.core.arch import preset
from lorafusion.layers import LoRAContext, lora_modules
from lorafusion.layers.lora_linear import LoRAColumnParallelLinear, LoRARowParallelLinear
from lorafusion.models.attention import PackedDotProductAttention
from lorafusion.models.fused.layer import FusedResidualLayer
from lorafusion.models.fused.rms_norm import RMSNorm
from lorafusion.models.fused.swiglu import SwiGLU
from lorafusion.models.layer_spec import lora_block_spec, lora_layer_spec
from lorafusion.models.spec import transformer_config


def _linear(cls, kind, number, ctx):
    return ModuleSpec(module=cls, params={"lora_kind": kind, "layer_number": number, "lora_context": ctx})


def _megatron_local_with_swaps(fused_ops: str, sequence_parallel: bool, number: int, ctx) -> ModuleSpec:
    """How the spec was built before (Megatron's local spec, copied, then mutated): the reference."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    attn.linear_qkv = _linear(LoRAColumnParallelLinear, "linear_qkv", number, ctx)
    attn.linear_proj = _linear(LoRARowParallelLinear, "linear_proj", number, ctx)
    attn.core_attention = PackedDotProductAttention
    mlp.linear_fc1 = _linear(LoRAColumnParallelLinear, "linear_fc1", number, ctx)
    mlp.linear_fc2 = _linear(LoRARowParallelLinear, "linear_fc2", number, ctx)
    norm_impl = None if fused_ops == "off" else fused_ops
    norm_impl = norm_impl or ("torch" if sequence_parallel else None)
    if norm_impl is not None:
        spec.submodules.input_layernorm = ModuleSpec(module=RMSNorm, params={"impl": norm_impl})
        spec.submodules.pre_mlp_layernorm = ModuleSpec(module=RMSNorm, params={"impl": norm_impl})
    if fused_ops != "off":
        mlp.activation_func = ModuleSpec(module=SwiGLU, params={"impl": fused_ops})
    if fused_ops == "triton":  # the attention residual add fused into pre_mlp_layernorm
        spec.module = FusedResidualLayer
    return spec


@pytest.mark.parametrize("fused_ops", ["off", "torch", "triton"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_literal_spec_equals_megatron_local_spec_with_swaps(fused_ops, sequence_parallel):
    ctx = LoRAContext()
    kw = dict(sequence_parallel=sequence_parallel, layer_number=3, lora_context=ctx)
    got = lora_layer_spec("local", fused_ops, **kw)
    assert got == _megatron_local_with_swaps(fused_ops, sequence_parallel, 3, ctx)
    assert got != _megatron_local_with_swaps(fused_ops, sequence_parallel, 3, LoRAContext())  # the context
    assert got != _megatron_local_with_swaps(fused_ops, sequence_parallel, 2, ctx)  # the layer number
    again = lora_layer_spec("local", fused_ops, **kw)
    assert again == got and again is not got  # fresh each call


def test_block_spec_numbers_the_layers_of_this_stage_and_the_linears_hold_their_wiring(megatron_single):
    from lorafusion.models.provider import build_model

    arch = preset("tiny-llama")
    cfg = transformer_config(arch)
    ctx = LoRAContext()
    block = lora_block_spec(cfg, ctx)
    numbers = [spec.submodules.self_attention.submodules.linear_qkv.params["layer_number"]
               for spec in block.layer_specs]
    assert numbers == list(range(1, arch.num_layers + 1))
    model = build_model(arch, seed=1, lora_impl="torch")
    ctx = model.lora_context
    assert ctx.impl == "torch" and sorted(ctx.layer_keys) == sorted(k for k, _ in lora_modules(model))
    for key, mod in lora_modules(model):
        number, kind = key.split(".", 1)
        assert (mod.layer_number, mod.lora_kind, mod.lora_ctx) == (int(number), kind, ctx)


def test_other_transformer_impl_is_named():
    with pytest.raises(ValueError, match="model.transformer_impl"):
        lora_layer_spec("te", layer_number=1, lora_context=LoRAContext())
