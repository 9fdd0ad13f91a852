"""Model level: the same tiny model with fused ops on ("torch", "triton" through the interpreter) and off
gives equal per-token losses and LoRA gradients on a packed two-adapter batch; state dicts, HF import,
logits, recompute and the automatic choice."""

import pytest
import torch

from lorafusion.data.packing import pack_microbatch
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import add_adapter
from lorafusion.models.fused import resolve_fused_ops
from lorafusion.models.provider import build_model
from lorafusion.core.arch import preset

from model_utils import lora_grads, per_token_loss, randomize_b


def _batch():
    g = torch.Generator().manual_seed(0)
    samples = [("a", torch.randint(0, 512, (9,), generator=g).tolist()),
               ("a", torch.randint(0, 512, (5,), generator=g).tolist()),
               ("b", torch.randint(0, 512, (12,), generator=g).tolist())]
    return pack_microbatch(samples, prompt_lengths=[2, 0, 3])


def _run(arch, mode, batch, **kw):
    model = build_model(arch, seed=3, fused_ops=mode, **kw)
    for n in "ab":
        add_adapter(model, n, LoRASpec(r=4, lora_alpha=8), seed=1)
    randomize_b(model, 0)
    loss = per_token_loss(model, batch)
    weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(5)) * batch.loss_mask
    (loss * weights).sum().backward()
    return model, loss.detach(), {**lora_grads(model, "a"), **lora_grads(model, "b")}


@pytest.mark.parametrize("name,layers,mode", [("tiny-llama", 2, "torch"), ("tiny-qwen2", 2, "torch"),
                                              ("tiny-llama", 1, "triton"), ("tiny-qwen2", 1, "triton")])
def test_fused_equals_megatron_ops(megatron_single, name, layers, mode):
    arch = preset(name, num_layers=layers)
    batch = _batch()
    off, loss0, g0 = _run(arch, "off", batch)
    on, loss1, g1 = _run(arch, mode, batch)
    assert on.config.fused_ops == mode and off.config.fused_ops == "off"
    assert loss1.shape == loss0.shape == batch.labels.shape and loss1.dtype == torch.float32
    assert torch.allclose(loss1, loss0, atol=1e-5, rtol=0), (loss1 - loss0).abs().max()
    assert g0.keys() == g1.keys() and len(g0) == 8 * layers
    for k in g0:
        assert ((g1[k] - g0[k]).norm() / g0[k].norm()).item() <= 1e-5, k
    # the fused model really runs the fused modules
    kinds = {type(m).__name__ for m in on.modules()}
    assert {"RMSNorm", "SwiGLU"} <= kinds and "RMSNorm" in type(on.decoder.final_layernorm).__name__
    assert on.decoder.layers[0].mlp.activation_func.impl == mode


def test_state_dicts_match_and_norms_in_params_dtype(megatron_single):
    arch = preset("tiny-qwen2", num_layers=2)
    off = build_model(arch, params_dtype=torch.bfloat16, fused_ops="off")
    on = build_model(arch, params_dtype=torch.bfloat16, fused_ops="torch")
    sd_off, sd_on = off.state_dict(), on.state_dict()
    assert ([k for k in sd_off if not k.endswith("_extra_state")]
            == [k for k in sd_on if not k.endswith("_extra_state")])
    for k, v in sd_on.items():
        if k.endswith("layernorm.weight"):
            assert v.dtype == torch.bfloat16 and torch.all(v == 1), k
            assert torch.equal(v.float(), sd_off[k].float())
        elif torch.is_tensor(v) and not k.endswith("_extra_state"):
            assert torch.equal(v, sd_off[k]), k


def test_hf_import_and_logits(megatron_single, tmp_path):
    from lorafusion.models.hf_import import build_model_from_hf

    from hf_utils import write_hf_checkpoint

    arch = preset("tiny-llama", num_layers=2)
    hf = write_hf_checkpoint(arch, tmp_path / "m", seed=1)
    off = build_model_from_hf(tmp_path / "m", fused_ops="off")
    on = build_model_from_hf(tmp_path / "m", fused_ops="torch")
    ids = torch.randint(0, arch.vocab_size, (2, 24))
    pos = torch.arange(24)[None].expand(2, -1)
    with torch.no_grad():
        a = off(ids, pos, attention_mask=None)
        b = on(ids, pos, attention_mask=None)  # labels=None: logits, as before
        ref = hf(ids).logits
    assert b.shape == a.shape == ref.shape
    assert (a - b).abs().max().item() <= 1e-5 and (b - ref).abs().max().item() <= 1e-4


def test_recompute_with_fused_ops(megatron_single):
    arch = preset("tiny-llama", num_layers=2)
    batch = _batch()
    _, loss0, g0 = _run(arch, "torch", batch)
    _, loss1, g1 = _run(arch, "torch", batch, recompute=True)
    assert torch.equal(loss0, loss1)
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-7, rtol=1e-6), k


def test_automatic_choice(megatron_single):
    assert resolve_fused_ops(None, None) == "off" and resolve_fused_ops(None, "cpu") == "off"
    assert (resolve_fused_ops(None, "cuda") == "triton"
            and resolve_fused_ops(None, torch.device("cuda", 0)) == "triton")
    assert resolve_fused_ops("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="fused_ops"):
        resolve_fused_ops("liger", None)
    assert build_model(preset("tiny-llama", num_layers=1)).config.fused_ops == "off"
