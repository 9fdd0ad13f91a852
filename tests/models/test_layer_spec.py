"""The literal layer spec (models/layer_spec.py) equals Megatron's local spec with our swaps, for every variant."""

import copy

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from lorafusion.layers.lora_linear import LoRAColumnParallelLinear, LoRARowParallelLinear
from lorafusion.models.attention import PackedDotProductAttention
from lorafusion.models.fused.rms_norm import RMSNorm
from lorafusion.models.fused.swiglu import SwiGLU
from lorafusion.models.layer_spec import lora_layer_spec


def _megatron_local_with_swaps(fused_ops: str, sequence_parallel: bool) -> ModuleSpec:
    """How the spec was built before (Megatron's local spec, copied, then mutated): the reference."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    attn.linear_qkv, attn.linear_proj = LoRAColumnParallelLinear, LoRARowParallelLinear
    attn.core_attention = PackedDotProductAttention
    mlp.linear_fc1, mlp.linear_fc2 = LoRAColumnParallelLinear, LoRARowParallelLinear
    norm_impl = None if fused_ops == "off" else fused_ops
    norm_impl = norm_impl or ("torch" if sequence_parallel else None)
    if norm_impl is not None:
        spec.submodules.input_layernorm = ModuleSpec(module=RMSNorm, params={"impl": norm_impl})
        spec.submodules.pre_mlp_layernorm = ModuleSpec(module=RMSNorm, params={"impl": norm_impl})
    if fused_ops != "off":
        mlp.activation_func = ModuleSpec(module=SwiGLU, params={"impl": fused_ops})
    return spec


@pytest.mark.parametrize("fused_ops", ["off", "torch", "triton"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_literal_spec_equals_megatron_local_spec_with_swaps(fused_ops, sequence_parallel):
    got = lora_layer_spec("local", fused_ops, sequence_parallel=sequence_parallel)
    assert got == _megatron_local_with_swaps(fused_ops, sequence_parallel)
    assert lora_layer_spec("local", fused_ops, sequence_parallel=sequence_parallel) is not got  # fresh each call


def test_other_transformer_impl_is_named():
    with pytest.raises(ValueError, match="model.transformer_impl"):
        lora_layer_spec("te")
