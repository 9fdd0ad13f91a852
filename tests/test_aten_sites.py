"""scripts/aten_sites.py: the ATen ops of one microbatch of the GPU path (fused ops, Triton LoRA, through the
interpreter) by call site, CPU-only attention ops left out."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import aten_sites  # noqa: E402


def test_one_layer_sites(megatron_single):
    counts = aten_sites.site_counts(1)
    adds = {k: n for k, n in counts.items() if k.startswith("aten.add.Tensor")}
    # the attention residual add runs inside pre_mlp_layernorm's kernel: Megatron's bda adds only the MLP's
    assert sum(n for k, n in adds.items() if "_forward_attention" in k) == 0, adds
    assert sum(n for k, n in adds.items() if "_forward_post_mlp" in k) == 1, adds
    assert not any("attention.py:causal_attention_reference" in k or "SliceBackward0" in k for k in counts)
    # the LoRA backward's reductions and the query copy are seen where they are made
    assert any("_FusedMultiLoRALinearBackward" in k and "aten.sum" in k for k in counts)
    assert counts["aten.clone.default @ attention.py:get_query_key_value_tensors <- attention.py:forward "
                  "<- transformer_layer.py:_forward_attention"] == 1
