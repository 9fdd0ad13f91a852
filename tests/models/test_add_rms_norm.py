"""The attention residual add fused into pre_mlp_layernorm: the same values as the add and the Triton RMSNorm
one after the other (forward s and y, backward dx with s's two gradients summed), and in the model two
activation-sized adds fewer per layer and microbatch with bit-identical losses and LoRA gradients."""

import pytest
import torch

from lorafusion.core.arch import preset
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import add_adapter
from lorafusion.models.fused.add_rms_norm import AddNormBda, add_rms_norm
from lorafusion.models.fused.rms_norm import rms_norm
from lorafusion.models.provider import build_model

from dispatch_utils import OpWatch
from model_utils import lora_grads, per_token_loss, randomize_b

from ._util import CPU_DTYPES
from .test_fused_model import _batch


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n,h", [(7, 48), (33, 64)])
def test_equals_add_then_norm(dtype, n, h):
    g = torch.Generator().manual_seed(n)
    x0, r0, ds, dy = ((torch.randn(n, 1, h, generator=g) * 3).to(dtype) for _ in range(4))
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    x, r = x0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
    s, y = add_rms_norm(x, r, w, 1e-5)
    torch.autograd.backward([s, y], [ds, dy])
    xu, ru = x0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
    su = ru + xu  # Megatron's bias-dropout-add without bias and dropout
    yu = rms_norm(su, w, 1e-5, impl="triton")
    torch.autograd.backward([su, yu], [ds, dy])
    assert torch.equal(s, su) and torch.equal(y, yu)
    assert torch.equal(x.grad, xu.grad) and torch.equal(r.grad, ru.grad)


def _model(layers, fused: bool):
    model = build_model(preset("tiny-llama", num_layers=layers), seed=3, fused_ops="triton")
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attn_bda, AddNormBda)
        if not fused:
            layer.self_attn_bda = layer.self_attn_bda.fallback
    for n in "ab":
        add_adapter(model, n, LoRASpec(r=4, lora_alpha=8), seed=1)
    randomize_b(model, 0)
    return model


def _step(model, batch):
    adds = []
    with OpWatch(flagged={"aten.add.Tensor", "aten.add_.Tensor"}, seen=adds):
        loss = per_token_loss(model, batch)
        weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(5)) * batch.loss_mask
        (loss * weights).sum().backward()
    return loss.detach(), {**lora_grads(model, "a"), **lora_grads(model, "b")}, len(adds)


def test_model_fuses_two_adds_per_layer_exactly(megatron_single):
    batch, layers = _batch(), 2
    loss0, g0, adds0 = _step(_model(layers, fused=False), batch)
    loss1, g1, adds1 = _step(_model(layers, fused=True), batch)
    assert adds0 - adds1 == 2 * layers, (adds0, adds1)
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys() and len(g0) == 8 * layers
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k


def test_bias_or_dropout_keeps_megatron_bda():
    calls = []

    def fallback(training, fused):
        return lambda xb, res, p: calls.append(p) or res + xb[0]

    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.nn.Parameter(torch.ones(8), requires_grad=False), 1e-5
    bda = AddNormBda(norm, fallback)
    x, r = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    bda(True, False)((x, None), r, 0.1)  # dropout in training
    bda(True, False)((x, torch.zeros(8)), r, 0.0)  # a bias
    bda(True, False)((x.double(), None), r, 0.0)  # dtypes differ
    assert calls == [0.1, 0.0, 0.0]
    s = bda(False, False)((x, None), r, 0.1)  # dropout off in eval: fused
    assert len(calls) == 3 and torch.equal(s, r + x)
