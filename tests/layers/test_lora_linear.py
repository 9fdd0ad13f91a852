"""Multi-adapter LoRA layers: packing isolation, init, live add/remove, and input validation."""

import pytest
import torch

from lorafusion.data import pack_microbatch
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import Routing, add_adapter, lora_batch, lora_modules, remove_adapter
from lorafusion.core.targets import resolve_target_modules
from lorafusion.models.provider import build_model
from lorafusion.core.arch import preset
from model_utils import adapter_losses, lora_grads, randomize_b

SPECS = {
    "a": LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",)),
    "b": LoRASpec(r=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
    "c": LoRASpec(r=16, lora_alpha=8, lora_dropout=0.2, target_modules=("linear_fc1", "linear_fc2"),
                  use_rslora=True),
}


def make_model(names=("a", "b", "c"), seed=3):
    model = build_model(preset("tiny-llama"), seed=11)
    for n in names:
        add_adapter(model, n, SPECS[n], seed=seed)
    randomize_b(model, seed=5)
    model.train()
    return model


def sample(seed, n):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SAMPLES = [("a", sample(1, 9)), ("a", sample(2, 5)), ("b", sample(3, 12)), ("c", sample(4, 7)),
           ("c", sample(5, 6))]


def test_packed_batch_gives_each_adapter_what_it_gets_alone(megatron_single):
    model = make_model()
    ids = list(range(len(SAMPLES)))
    packed = pack_microbatch(SAMPLES, row_ids=ids)
    losses = adapter_losses(model, packed)
    sum(losses.values()).backward()
    grads = {n: lora_grads(model, n) for n in SPECS}
    for name in SPECS:
        model.zero_grad(set_to_none=True)
        idx = [i for i, (n, _) in enumerate(SAMPLES) if n == name]
        alone = pack_microbatch([SAMPLES[i] for i in idx], row_ids=idx)
        loss_alone = adapter_losses(model, alone)[name]
        loss_alone.backward()
        torch.testing.assert_close(losses[name], loss_alone, rtol=1e-6, atol=0)
        g_alone = lora_grads(model, name)
        assert g_alone.keys() == grads[name].keys()
        for k in g_alone:
            torch.testing.assert_close(grads[name][k], g_alone[k], rtol=1e-5, atol=1e-7)


def test_tp_geometry_is_read_once_at_construction(megatron_single, monkeypatch):
    """A LoRA linear reads its TP world size and rank from its own group when it is built; forward and
    backward ask Megatron's parallel state nothing for it (the calls cost host time per linear call)."""
    import types

    import lorafusion.layers.lora_linear as ll

    model = make_model()
    mods = [m for _, m in lora_modules(model)]
    assert mods and all(m._tp() == (1, 0) for m in mods)

    def refuse(*a, **k):
        raise AssertionError("parallel_state asked in a LoRA linear's forward or backward")

    # (raising=False: the module need not import parallel_state at all; if it does, every look-up fails)
    monkeypatch.setattr(ll, "parallel_state", types.SimpleNamespace(
        get_tensor_model_parallel_world_size=refuse, get_tensor_model_parallel_rank=refuse,
        get_tensor_model_parallel_group=refuse), raising=False)
    packed = pack_microbatch(SAMPLES, row_ids=list(range(len(SAMPLES))))
    sum(adapter_losses(model, packed).values()).backward()
    assert all(m._tp() == (1, 0) for m in mods)


def test_other_adapters_tokens_do_not_touch_adapter_grads_bitwise(megatron_single):
    model = make_model()
    ids = list(range(len(SAMPLES)))

    def grads_a(samples):
        model.zero_grad(set_to_none=True)
        sum(adapter_losses(model, pack_microbatch(samples, row_ids=ids)).values()).backward()
        return lora_grads(model, "a")

    g1 = grads_a(SAMPLES)
    changed = list(SAMPLES)
    changed[2] = ("b", sample(99, 12))  # same length, different tokens
    g2 = grads_a(changed)
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k


def test_init_is_independent_of_other_adapters(megatron_single):
    m1 = build_model(preset("tiny-llama"))
    m2 = build_model(preset("tiny-llama"))
    add_adapter(m1, "a", SPECS["a"], seed=3)
    add_adapter(m2, "c", SPECS["c"], seed=3)
    add_adapter(m2, "a", SPECS["a"], seed=3)
    for (k1, mod1), (k2, mod2) in zip(lora_modules(m1), lora_modules(m2)):
        assert torch.equal(mod1.lora_A["a"], mod2.lora_A["a"])
        assert torch.count_nonzero(mod1.lora_B["a"]) == 0
        bound = 1 / mod1.lora_A["a"].shape[1] ** 0.5
        assert mod1.lora_A["a"].abs().max() <= bound
    # a different run seed gives a different init
    m3 = build_model(preset("tiny-llama"))
    add_adapter(m3, "a", SPECS["a"], seed=4)
    assert not torch.equal(next(lora_modules(m3))[1].lora_A["a"], next(lora_modules(m1))[1].lora_A["a"])


def test_adapters_added_and_removed_on_live_model(megatron_single):
    model = build_model(preset("tiny-llama"))
    model.eval()
    ids = torch.randint(0, 512, (1, 10))
    pos = torch.arange(10)[None]
    base = model(ids, pos, attention_mask=None)
    add_adapter(model, "x", SPECS["b"], seed=0)
    randomize_b(model)
    with lora_batch(model, Routing.single(10), ["x"]):
        with_x = model(ids, pos, attention_mask=None)
    assert (with_x - base).abs().max() > 1e-4
    remove_adapter(model, "x")
    assert all(len(m.lora_A) == 0 for _, m in lora_modules(model))
    torch.testing.assert_close(model(ids, pos, attention_mask=None), base, rtol=0, atol=0)
    add_adapter(model, "x", SPECS["a"], seed=0)  # the name is free again


def test_adapter_name_clash_is_an_error(megatron_single):
    model = make_model(("a",))
    with pytest.raises(ValueError, match="adapter name clash: 'a'"):
        add_adapter(model, "a", SPECS["b"])
    with pytest.raises(ValueError, match="adapter name"):
        add_adapter(model, "has.dot", SPECS["b"])


def test_routing_to_unknown_adapter_is_an_error(megatron_single):
    model = make_model(("a",))
    with pytest.raises(KeyError, match="'zz'"):
        with lora_batch(model, Routing.single(4), ["zz"]):
            pass


@pytest.mark.parametrize("kwargs, field", [
    (dict(r=0, lora_alpha=8), "lora.r"),
    (dict(r=-2, lora_alpha=8), "lora.r"),
    (dict(r=2.5, lora_alpha=8), "lora.r"),
    (dict(r=4, lora_alpha=0), "lora.lora_alpha"),
    (dict(r=4, lora_alpha=-1.0), "lora.lora_alpha"),
    (dict(r=4, lora_alpha=8, lora_dropout=1.0), "lora.lora_dropout"),
    (dict(r=4, lora_alpha=8, lora_dropout=-0.1), "lora.lora_dropout"),
    (dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), shared_fused_a=True),
     "lora.target_modules: q_proj, v_proj is part of the fused linear_qkv; one shared A"),
    (dict(r=4, lora_alpha=8, target_modules=("gate_proj",), shared_fused_a=True), "shared_fused_a: false"),
    (dict(r=4, lora_alpha=8, target_modules=("lm_head",)), "unknown module 'lm_head'"),
    (dict(r=4, lora_alpha=8, target_modules=()), "at least one"),
])
def test_bad_lora_spec_is_one_clear_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRASpec(**kwargs)


def test_target_mapping_is_exact():
    assert resolve_target_modules("all-linear") == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert resolve_target_modules(["down_proj", "q_proj", "k_proj", "v_proj"]) == ("linear_qkv", "linear_fc2")
    assert resolve_target_modules(["gate_proj", "up_proj", "linear_proj"]) == ("linear_proj", "linear_fc1")
    # a subset of a fused linear's projections keeps its PEFT names (each its own A and B)
    assert resolve_target_modules(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    assert resolve_target_modules(["down_proj", "gate_proj", "q_proj"]) == (
        "q_proj", "gate_proj", "linear_fc2")
    spec = LoRASpec(r=2, lora_alpha=2, target_modules=["v_proj", "up_proj", "o_proj"])
    assert spec.megatron_targets == ("linear_qkv", "linear_proj", "linear_fc1")
    assert spec.projections("linear_qkv") == ("v_proj",) and spec.projections("linear_fc2") == ()


@pytest.mark.parametrize("segments, msg", [
    (((0, 0, 4), (1, 2, 4)), "non-overlapping"),
    (((0, 0, 0),), "length>0"),
    (((0, 0, 20),), "ends at row 20"),
])
def test_bad_routing_is_an_error(segments, msg):
    with pytest.raises(ValueError, match=msg):
        Routing(segments=segments, num_rows=10)


FUSED_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
from lorafusion.dist import init_distributed
init_distributed(1, 1)
from lorafusion.data import pack_microbatch
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import add_adapter, get_lora_context, lora_modules
from lorafusion.models.provider import build_model
from lorafusion.core.arch import ModelArch
from model_utils import adapter_losses, lora_grads, randomize_b
arch = ModelArch(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=64)
model = build_model(arch, seed=1)
add_adapter(model, "a", LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1), seed=0)
add_adapter(model, "b", LoRASpec(r=16, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj")), seed=0)
add_adapter(model, "c", LoRASpec(r=3, lora_alpha=6, lora_dropout=0.2,
                                 target_modules=("q_proj", "v_proj", "up_proj")), seed=0)
add_adapter(model, "d", LoRASpec(r=5, lora_alpha=8, shared_fused_a=True), seed=0)
randomize_b(model, seed=2)
model.train()
g = torch.Generator().manual_seed(0)
batch = pack_microbatch([("a", torch.randint(0, 64, (13,), generator=g).tolist()),
                         ("b", torch.randint(0, 64, (9,), generator=g).tolist()),
                         ("c", torch.randint(0, 64, (6,), generator=g).tolist()),
                         ("d", torch.randint(0, 64, (5,), generator=g).tolist()),
                         ("a", torch.randint(0, 64, (7,), generator=g).tolist())], row_ids=[0, 1, 2, 3, 4])
out = {}
for impl in ("torch", "triton"):
    get_lora_context(model).impl = impl
    model.zero_grad(set_to_none=True)
    losses = adapter_losses(model, batch)
    sum(losses.values()).backward()
    out[impl] = ({k: v.item() for k, v in losses.items()}, {n: lora_grads(model, n) for n in "abcd"})
for n in "abcd":
    assert abs(out["triton"][0][n] - out["torch"][0][n]) <= 1e-5 * abs(out["torch"][0][n]), out
    for k, v in out["torch"][1][n].items():
        err = (out["triton"][1][n][k] - v).norm() / v.norm().clamp_min(1e-12)
        assert err <= 1e-4, (n, k, float(err))
print("ok")
"""


def test_fused_kernels_in_the_layers_match_reference_under_interpreter(tmp_path):
    """The layers' fused path (base GEMM + LoRA in one op, TP=1) gives the reference's loss and grads,
    dropout included (the kernels draw the same counter-based mask); Triton's interpreter on CPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{tests}:{tests.parent}")
    res = subprocess.run([sys.executable, "-c", FUSED_SCRIPT, str(tests)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
