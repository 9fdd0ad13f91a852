"""What a decoder layer keeps for backward: the LoRA linears' normed inputs (qkv, fc1) and the SwiGLU output
(fc2's input) are rebuilt in backward (lorafusion/ops/saved.py), not kept. The loss, every adapter's LoRA
gradients and the input gradient equal the plain graph's (``keep_saved``) bit for bit — with and without
Megatron's layer recompute, the fused ops in torch and Triton, the LoRA kernels in torch and Triton (the
interpreter on CPU), fp32 / fp16 / bf16 and the FP8 base — and the bytes saved per token and kept layer drop
by ``f + 2h`` elements: what the memory model (``scheduler.memory.saved_elems``) counts, checked against the
bytes counted on the GPU's path (Triton fused ops and LoRA kernels, per-sample attention on CPU)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lorafusion.core.arch import ModelArch
from lorafusion.core.lora import LoRASpec
from lorafusion.data import pack_microbatch
from lorafusion.layers import add_adapter, lora_batch, lora_modules
from lorafusion.models.provider import build_model
from lorafusion.ops.saved import REBUILT, keep_saved
from model_utils import randomize_b, tokens

ROOT = Path(__file__).resolve().parents[2]
# h = 64, f = 160: the two rebuilt widths differ (a count of one for the other would show)
ARCH = ModelArch("llama", vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=160)
SPECS = {
    "a": LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",)),
    # no dropout: the CPU reference LoRA path then saves views of X (with dropout it saves the dropped X)
    "b": LoRASpec(r=8, lora_alpha=8, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj")),
    "c": LoRASpec(r=2, lora_alpha=4, lora_dropout=0.2, target_modules=("all-linear",), shared_fused_a=True),
}


def _model(fused, lora_impl, dtype, recompute_layers=None, **kw):
    model = build_model(ARCH, params_dtype=dtype, fused_ops=fused, lora_impl=lora_impl, seed=5,
                        recompute=recompute_layers is not None, recompute_layers=recompute_layers, **kw)
    for i, (name, spec) in enumerate(SPECS.items()):
        add_adapter(model, name, spec, seed=i)
    randomize_b(model, seed=2)
    return model.train()


def _batch(n):
    v = ARCH.vocab_size
    samples = [("a", tokens(1, n, v)), ("b", tokens(2, n // 2 + 3, v)), ("c", tokens(3, n // 3, v))]
    return pack_microbatch(samples, row_ids=[0, 1, 2])


def _step(model, batch, keep: bool):
    """(loss, {name: grad}) of one forward and backward; the input gradient is the embedding output's (made
    a leaf, as a pipeline stage's received activations are)."""
    leaf = []

    def as_leaf(_mod, _inp, out):
        leaf.append(out.detach().requires_grad_(True))
        return leaf[0]

    hook = model.embedding.register_forward_hook(as_leaf)
    model.zero_grad(set_to_none=True)
    try:
        with keep_saved() if keep else contextlib.nullcontext():
            with lora_batch(model, batch.routing, batch.adapters, [7, 8, 9]):
                per_token = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                                  packed_seq_params=batch.packed_seq_params())
            loss = (per_token.float() * batch.loss_mask).sum()
            loss.backward()
    finally:
        hook.remove()
    grads = {f"{key}.{p}.{n}": getattr(mod, p)[n].grad.clone()
             for key, mod in lora_modules(model) for p in ("lora_A", "lora_B") for n in getattr(mod, p)}
    grads["input"] = leaf[0].grad.clone()
    return loss.detach(), grads


def _check_equal(model, batch):
    n0 = REBUILT["recomputed"]
    want_loss, want = _step(model, batch, keep=True)
    n1 = REBUILT["recomputed"]
    got_loss, got = _step(model, batch, keep=False)
    assert n1 == n0 and REBUILT["recomputed"] > n1  # the plain graph rebuilt nothing; this one did
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys() and len(want) > 10
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("recompute_layers", [None, 1])
def test_torch_ops_equal_the_plain_graph(megatron_single, dtype, recompute_layers):
    """Fused ops and LoRA in torch; ``recompute_layers`` 1: the first layer recomputed, the second kept."""
    _check_equal(_model("torch", "torch", dtype, recompute_layers), _batch(24))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, recompute_layers", [(torch.float32, None), (torch.float16, 1)])
def test_triton_ops_and_kernels_equal_the_plain_graph(megatron_single, dtype, recompute_layers):
    """The GPU's path: the Triton RMSNorm, Liger's SwiGLU, the fused LoRA linear (one op without TP). (The
    interpreter's bf16 dot is wrong: bf16 runs on a GPU.)"""
    _check_equal(_model("triton", "triton", dtype, recompute_layers), _batch(12))


@pytest.mark.parametrize("lora_impl, dtype", [("torch", torch.bfloat16), ("triton", torch.float32)])
def test_fp8_base_equals_the_plain_graph(megatron_single, lora_impl, dtype):
    """FP8 base: the split form (torch LoRA) and the one FP8 + LoRA op (Triton kernels)."""
    model = _model(lora_impl, lora_impl, dtype, base_precision="fp8", fp8_bf16_layers=0)
    _check_equal(model, _batch(12))


COUNT_SPEC = LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",))


def _count_batch(capacity):
    half = capacity // 2
    return pack_microbatch([("a", tokens(4, half, ARCH.vocab_size)),
                            ("b", tokens(5, capacity - half, ARCH.vocab_size))], row_ids=[0, 1])


def _bytes_per_token(layers: int, caps=(32, 64)) -> dict[bool, float]:
    """Saved bytes per token of one forward of a ``layers``-layer model on the GPU's path, counted as
    scripts/count_saved_bytes.py counts (distinct storages, the frozen weights left out): the plain graph
    (True) and with the rebuild (False)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from count_saved_bytes import _saved_bytes
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    model = build_model(replace(ARCH, num_layers=layers), params_dtype=torch.float16, fused_ops="triton",
                        lora_impl="triton", seed=5).train()
    for i, name in enumerate("ab"):
        add_adapter(model, name, COUNT_SPEC, seed=i)
    out = {}
    for keep in (True, False):
        with keep_saved() if keep else contextlib.nullcontext():
            sizes = [_saved_bytes(model, _count_batch(c), None) for c in caps]
        out[keep] = (sizes[1] - sizes[0]) / (caps[1] - caps[0])
    return out


@pytest.mark.slow
def test_a_kept_layer_saves_f_plus_2h_fewer_elements_as_the_memory_model_counts(megatron_single):
    """One decoder layer's saved bytes per token (a two-layer model's less a one-layer model's: the first
    layer of a model, whose input needs no gradient, keeps its normed qkv input and not the layer input)."""
    from lorafusion.scheduler.memory import AdapterShape, MemorySetup, lora_elems, saved_elems

    one, two = _bytes_per_token(1), _bytes_per_token(2)
    got = {keep: two[keep] - one[keep] for keep in (True, False)}
    h, f, b = ARCH.hidden_size, ARCH.ffn_hidden_size, 2
    assert got[True] - got[False] == (f + 2 * h) * b
    shapes = (AdapterShape(4, dropout=0.1, independent_a=True),) * 2
    # besides what the model counts, fp32 per token: the two norms' rstd, the per-sample attention's lse
    small = 4 * 2 + 4 * ARCH.num_attention_heads
    for rebuilt in (True, False):
        setup = MemorySetup(ARCH, shapes, dtype="float16", attention="per-sample", rebuilt_inputs=rebuilt)
        assert got[not rebuilt] == b * (saved_elems(setup) + lora_elems(setup)) + small, rebuilt
