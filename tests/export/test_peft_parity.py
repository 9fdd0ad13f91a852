"""Our Megatron model + adapters vs HF transformers + real PEFT on the same weights (fp32, CPU)."""

import copy

import pytest
import torch

from hf_utils import write_hf_checkpoint
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import Routing, add_adapter, lora_batch, lora_modules
from lorafusion.models.hf_import import build_model_from_hf
from lorafusion.core.arch import ModelArch, preset
from lorafusion.export.peft import adapter_peft_state, export_peft_adapter, import_peft_adapter

peft = pytest.importorskip("peft")

ADAPTERS = {
    "alpha": LoRASpec(r=4, lora_alpha=8, target_modules=("all-linear",)),
    "beta": LoRASpec(r=8, lora_alpha=4, target_modules=("q_proj", "k_proj", "v_proj", "down_proj")),
    "gamma": LoRASpec(r=16, lora_alpha=32, target_modules=("linear_fc1", "linear_proj"), use_rslora=True),
    "qv": LoRASpec(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj")),
    "gd": LoRASpec(r=4, lora_alpha=4, target_modules=("gate_proj", "down_proj"), use_rslora=True),
    "kup": LoRASpec(r=2, lora_alpha=4, target_modules=("k_proj", "up_proj", "o_proj")),
    "shared": LoRASpec(r=4, lora_alpha=8, target_modules=("all-linear",), shared_fused_a=True),
}
ARCHS = {
    "llama-gqa": preset("tiny-llama"),
    "qwen2-tied": preset("tiny-qwen2"),
    "llama-odd": ModelArch(family="llama", vocab_size=97, hidden_size=72, num_layers=2, num_attention_heads=6,
                           num_query_groups=3, ffn_hidden_size=100, rope_theta=500000.0,
                           rope_scaling=preset("llama3.1-8b").rope_scaling, max_position_embeddings=256),
}


def randomize_adapters(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for name in mod.lora_B:
                mod.lora_B[name].copy_(torch.randn(mod.lora_B[name].shape, generator=gen) * 0.2)
                mod.lora_A[name].add_(torch.randn(mod.lora_A[name].shape, generator=gen) * 0.05)


def ours_logits(model, ids, name):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with lora_batch(model, Routing.single(ids.numel()), [name]):
        # Megatron's [s, b] row order: rows are (s, b) flattened, all rows go to one adapter here.
        return model(ids, pos, attention_mask=None)


@pytest.fixture(scope="module", params=list(ARCHS))
def setup(request, tmp_path_factory, megatron_single):
    arch = ARCHS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf = write_hf_checkpoint(arch, d / "base", shards=2)
    model = build_model_from_hf(d / "base")
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        add_adapter(model, name, spec, seed=i)
    randomize_adapters(model)
    for name in ADAPTERS:
        export_peft_adapter(model, name, d / "adapters" / name, base_model=str(d / "base"))
    return arch, hf, model, d


def test_exported_adapters_reproduce_logits_in_peft(setup):
    arch, hf, model, d = setup
    ids = torch.randint(0, arch.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), d / "adapters" / "alpha", adapter_name="alpha")
    for name in list(ADAPTERS)[1:]:
        pm.load_adapter(d / "adapters" / name, adapter_name=name)
    pm.eval()
    model.eval()
    base = hf(ids).logits
    for name in ADAPTERS:
        pm.set_adapter(name)
        ref = pm(ids).logits
        ours = ours_logits(model, ids, name)
        assert (ref - base).abs().max() > 1e-3, "B is non-zero: adapters must change the logits"
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _peft_grads(pm):
    return {n: p.grad for n, p in pm.named_parameters() if "lora_" in n and p.grad is not None}


def test_loss_and_grads_match_peft(setup):
    arch, hf, model, d = setup
    model.train()
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    for name in ADAPTERS:
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), d / "adapters" / name, is_trainable=True)
        logits = pm(ids).logits
        ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, arch.vocab_size),
                                                     ids[:, 1:].reshape(-1))
        ref_loss.backward()
        grads = _peft_grads(pm)

        model.zero_grad(set_to_none=True)
        for _, mod in lora_modules(model):
            for p in list(mod.lora_A.values()) + list(mod.lora_B.values()):
                p.requires_grad_(True)
        out = ours_logits(model, ids, name)
        loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, arch.vocab_size),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)

        # Our grads in PEFT keys through the export mapping (dA of a fused linear = sum over q/k/v).
        gstate = adapter_peft_state(model, name, arch, grad=True)
        checked = 0
        for k, g_ref in grads.items():
            kk = k.replace(f".{name}.weight", ".weight").replace(".default.weight", ".weight")
            g_ours = gstate[kk]
            if name == "shared" and ".lora_A." in kk and any(
                    m in kk for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                # fused linear: our dA is the sum of PEFT's per-projection dA
                group = (("q_proj", "k_proj", "v_proj") if "_proj" in kk and "self_attn" in kk
                         else ("gate_proj", "up_proj"))
                here = next(m for m in group if m in kk)
                g_ref = sum(grads[k.replace(here, m)] for m in group)
            scale = g_ref.abs().max().clamp_min(1e-12)
            assert (g_ours - g_ref).abs().max() / scale <= 1e-5, kk
            checked += 1
        assert checked >= 4


def test_import_roundtrip_exact(setup, tmp_path):
    arch, hf, model, d = setup
    for name in ADAPTERS:
        import_peft_adapter(model, f"{name}_copy", d / "adapters" / name)
        export_peft_adapter(model, f"{name}_copy", tmp_path / name)
        from safetensors.torch import load_file

        a = load_file(d / "adapters" / name / "adapter_model.safetensors")
        b = load_file(tmp_path / name / "adapter_model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
