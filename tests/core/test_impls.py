"""One vocabulary for "which implementation runs an op" (lorafusion.core.impls): the run YAML's `kernels`
words map onto it, the LoRA ops and the fused model ops take it, summary.json keeps the YAML's word."""

import pytest
import torch

from lorafusion import ops
from lorafusion.core.impls import IMPLS, KERNELS, check_impl, kernels_name, lora_impl
from lorafusion.models.fused import FUSED_OPS_MODES


def test_the_yaml_words_map_onto_the_one_vocabulary_and_back():
    assert IMPLS == ("torch", "triton") and FUSED_OPS_MODES == ("off", "torch", "triton")
    assert {k: lora_impl(k) for k in KERNELS} == {"auto": None, "fused": "triton", "reference": "torch"}
    assert kernels_name("triton") == "fused" and kernels_name("torch") == "reference"
    with pytest.raises(ValueError, match="impl: expected one of"):
        check_impl("fused")  # the model ops take only the one vocabulary


def test_the_lora_ops_take_either_spelling():
    x = torch.zeros(2, 3)
    assert ops.resolve_impl(x) == "torch"  # automatic on the CPU
    assert ops.resolve_impl(x, "reference") == ops.resolve_impl(x, "torch") == "torch"
    assert ops.resolve_impl(x, "fused") == ops.resolve_impl(x, "triton") == "triton"
    with pytest.raises(ValueError, match="kernels: expected one of"):
        ops.resolve_impl(x, "cuda")
