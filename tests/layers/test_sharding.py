"""The parallel linears own their TP sharding (layers/sharding.py): what each one says of its tensors, and
TPSplit's shard / unshard. (The TP=2 equality tests in tests/test_parallel.py and tests/runtime check that
init, HF import and PEFT import/export, which ask these, give the single-process model.)"""

import pytest
import torch

from lorafusion.core.arch import ModelArch
from lorafusion.layers.sharding import COLUMNS, REPLICATED, ROW_HALVES, ROWS, TPSplit, param_split

ARCH = ModelArch(family="qwen2", vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=48, qkv_bias=True, max_position_embeddings=64)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_and_unshard_are_inverse_and_cut_as_megatron_does(tp):
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    for split in (ROWS, COLUMNS, ROW_HALVES, REPLICATED):
        parts = [split.shard(full, tp, r) for r in range(tp)]
        assert torch.equal(split.unshard(parts), full)
        assert all(tuple(p.shape) == split.local_shape(tuple(full.shape), tp) for p in parts)
        assert split.full_shape(tuple(parts[0].shape), tp) == tuple(full.shape)
    gate, up = full.chunk(2)
    for r in range(tp):  # [gate; up] rows: each rank holds [its gate shard; its up shard]
        assert torch.equal(ROW_HALVES.shard(full, tp, r), torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        assert torch.equal(COLUMNS.shard(full, tp, r), full.chunk(tp, dim=1)[r])
    assert REPLICATED.shard(full, tp, 0) is full
    with pytest.raises(ValueError, match="not divisible by tp=5"):
        ROWS.shard(full, 5, 0)


def test_each_linear_names_the_split_of_its_tensors(megatron_single):
    from lorafusion.models.provider import build_model

    model = build_model(ARCH, seed=1)
    layer = model.decoder.layers[0]
    qkv, proj = layer.self_attention.linear_qkv, layer.self_attention.linear_proj
    fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
    assert [m.lora_kind for m in (qkv, proj, fc1, fc2)] == ["linear_qkv", "linear_proj",
                                                            "linear_fc1", "linear_fc2"]
    column = {"weight": ROWS, "bias": ROWS, "lora_A": REPLICATED, "lora_B": ROWS, "lora_B_proj": ROWS}
    assert {t: param_split(qkv, t) for t in column} == column
    assert {t: param_split(fc1, t) for t in column} == {**column, "weight": ROW_HALVES, "bias": ROW_HALVES,
                                                        "lora_B": ROW_HALVES}
    row = {"weight": COLUMNS, "bias": REPLICATED, "lora_A": COLUMNS, "lora_B": REPLICATED}
    assert {t: param_split(proj, t) for t in row} == {t: param_split(fc2, t) for t in row} == row
    # Megatron's own modules: the vocab-parallel embedding and the output layer split rows; norms replicate
    assert param_split(model.embedding.word_embeddings, "weight") == ROWS
    assert param_split(model.output_layer, "weight") == ROWS
    assert param_split(layer.input_layernorm, "weight") == REPLICATED
    assert TPSplit(0, halves=True) == ROW_HALVES
