"""A LoRA linear's per-microbatch arguments are computed once per microbatch and set of adapters and shared
by the layers, and never outlive the microbatch, the adapters or the train/eval mode they were made for."""

import torch

from lorafusion.core.arch import preset
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import Routing, add_adapter, lora_modules, remove_adapter, set_batch
from lorafusion.models.provider import build_model

A = LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",))
B = LoRASpec(r=8, lora_alpha=8, lora_dropout=0.2, target_modules=("all-linear",))


def _mods(model):
    return dict(lora_modules(model))


def test_lora_args_follow_the_microbatch_adapters_and_mode(megatron_single):
    model = build_model(preset("tiny-llama"), seed=1)
    add_adapter(model, "a", A, seed=0)
    add_adapter(model, "b", B, seed=0)
    model.train()
    mods = _mods(model)
    qkv, proj = mods["1.linear_qkv"], mods["1.linear_proj"]
    x = torch.zeros(10, 1, qkv.input_size)

    r1 = Routing.from_lengths([0, 1], [4, 6])
    set_batch(model, r1, ["a", "b"], seeds=[1, 2])
    args = qkv._lora_args(x)
    assert args[0].segments == r1.segments and args[3] == (A.scaling, B.scaling) and args[4] == (0.1, 0.2)
    shared = proj._lora_args(x)  # computed once, shared by the layers of the microbatch
    assert shared[0] is args[0] and shared[3] is args[3]
    seeds1 = args[5]

    r2 = Routing.from_lengths([0], [10])  # next microbatch: one adapter
    set_batch(model, r2, ["b"], seeds=[5])
    args = qkv._lora_args(x)
    assert args[0].segments == r2.segments and args[3] == (B.scaling,) and args[4] == (0.2,)
    assert len(args[1]) == 1 and args[1][0] is qkv.lora_A["b"]
    assert args[5] != seeds1[1:]

    model.eval()  # no dropout outside training, same microbatch
    assert qkv._lora_args(x)[4] == (0.0,)
    model.train()
    assert qkv._lora_args(x)[4] == (0.2,)

    # the adapter replaced by another of the same name, same microbatch: its new spec, its new weights
    remove_adapter(model, "b")
    assert qkv._lora_args(x) is None  # the batch named it: cleared
    c = LoRASpec(r=4, lora_alpha=16, lora_dropout=0.3, target_modules=("all-linear",))
    add_adapter(model, "b", c, seed=1)
    set_batch(model, r2, ["b"], seeds=[5])
    args = qkv._lora_args(x)
    assert args[3] == (c.scaling,) and args[4] == (0.3,) and args[1][0] is qkv.lora_A["b"]
    assert args[1][0].shape[0] == 3 * 4  # the fused q/k/v A's of rank 4

    # an adapter added while a microbatch is set (not in its routing) changes nothing of it
    set_batch(model, r1, ["a", "b"], seeds=[1, 2])
    before = qkv._lora_args(x)
    add_adapter(model, "z", A, seed=2)
    after = qkv._lora_args(x)
    assert after[3] == before[3] and after[0].segments == before[0].segments
