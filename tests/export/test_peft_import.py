"""Adapters made by PEFT itself (an A per projection, any subset of targets) on odd-shaped HF LLaMA and Qwen2
(GQA, tied embeddings, q/k/v bias): imported, their logits equal transformers + PEFT; imported and exported
again without training, every tensor comes back bit for bit; trained step by step, losses and every A/B
gradient equal PEFT's own training (fp32)."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from hf_utils import write_hf_checkpoint
from lorafusion.core.arch import ModelArch
from lorafusion.core.errors import ConfigError
from lorafusion.core.lora import LoRASpec
from lorafusion.export.peft import adapter_peft_state, export_peft_adapter, import_peft_adapter
from lorafusion.layers import Routing, adapter_parameters, lora_batch, remove_adapter
from lorafusion.models.hf_import import build_model_from_hf

peft = pytest.importorskip("peft")

ARCHS = {
    "llama-odd-gqa": ModelArch(family="llama", vocab_size=97, hidden_size=72, num_layers=2,
                               num_attention_heads=6, num_query_groups=3, ffn_hidden_size=100,
                               max_position_embeddings=128),
    "qwen2-tied-bias": ModelArch(family="qwen2", vocab_size=89, hidden_size=56, num_layers=2,
                                 num_attention_heads=4, num_query_groups=2, ffn_hidden_size=76, qkv_bias=True,
                                 tie_word_embeddings=True, rope_theta=1e6, norm_eps=1e-6,
                                 max_position_embeddings=128),
}
TARGETS = {"all-linear": "all-linear", "q-v": ["q_proj", "v_proj"], "gate-down": ["gate_proj", "down_proj"]}
LOGITS_TOL = 1e-5


def _ids(arch, seed, n=(2, 12)):
    return torch.randint(0, arch.vocab_size, n, generator=torch.Generator().manual_seed(seed))


def _loss(logits, ids, vocab):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))


def _ours(model, ids, name):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with lora_batch(model, Routing.single(ids.numel()), [name]):
        return model(ids, pos, attention_mask=None)


def _peft_trained(hf, arch, targets, path, r=8, rslora=False):
    """A PEFT adapter made and trained by PEFT (two SGD steps: B non-zero, each projection's A its own)."""
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM", use_rslora=rslora)
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=2.0)
    for step in range(2):
        ids = _ids(arch, 100 + step)
        _loss(pm(ids).logits, ids, arch.vocab_size).backward()
        opt.step()
        opt.zero_grad()
    pm.save_pretrained(path)
    return pm


@pytest.fixture(scope="module", params=list(ARCHS))
def base(request, tmp_path_factory, megatron_single):
    arch = ARCHS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf = write_hf_checkpoint(arch, d / "base")
    return arch, hf, build_model_from_hf(d / "base"), d


@pytest.mark.parametrize("targets", list(TARGETS))
def test_peft_made_adapter_imports_with_equal_logits_and_exports_back_bitwise(base, targets):
    arch, hf, model, d = base
    pm = _peft_trained(hf, arch, TARGETS[targets], d / targets, rslora=targets == "gate-down")
    pm.eval()
    model.eval()
    spec = import_peft_adapter(model, "x", d / targets)
    try:
        ids = _ids(arch, 1)
        ref, plain = pm(ids).logits, hf(ids).logits
        assert (ref - plain).abs().max() > 1e-3  # the adapter changes the logits
        assert (_ours(model, ids, "x") - ref).abs().max().item() <= LOGITS_TOL
        export_peft_adapter(model, "x", d / f"{targets}-again", base_model=str(d / "base"))
        want = load_file(d / targets / "adapter_model.safetensors")
        got = load_file(d / f"{targets}-again" / "adapter_model.safetensors")
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        # the export loads in PEFT (the import's own reader) and names its base
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), d / f"{targets}-again").eval()
        torch.testing.assert_close(reloaded(ids).logits, ref, rtol=0, atol=0)
        assert spec.target_modules == LoRASpec(r=8, lora_alpha=16,
                                               target_modules=TARGETS[targets]).target_modules
    finally:
        remove_adapter(model, "x")


def test_q_v_r8_trains_step_by_step_like_peft(base):
    """Three AdamW steps on the same batches: each step's loss and every A/B gradient equal PEFT's (fp32,
    1e-5)."""
    arch, hf, model, d = base
    _peft_trained(hf, arch, ["q_proj", "v_proj"], d / "qv-train")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), d / "qv-train", is_trainable=True)
    import_peft_adapter(model, "qv", d / "qv-train")
    try:
        pm.train()
        model.train()
        theirs = {n.replace(".default", ""): p for n, p in pm.named_parameters() if p.requires_grad}
        ours = list(adapter_parameters(model, "qv").values())
        opt_t = torch.optim.AdamW(theirs.values(), lr=1e-2, weight_decay=0.01)
        opt_o = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.01)
        for step in range(3):
            ids = _ids(arch, 200 + step)
            loss_t = _loss(pm(ids).logits, ids, arch.vocab_size)
            loss_t.backward()
            loss_o = _loss(_ours(model, ids, "qv"), ids, arch.vocab_size)
            loss_o.backward()
            assert abs(loss_o.item() - loss_t.item()) <= 1e-5 * abs(loss_t.item()), step
            grads = adapter_peft_state(model, "qv", arch, grad=True)
            assert grads.keys() == theirs.keys() and len(grads) == 4 * arch.num_layers
            for k, p in theirs.items():
                scale = p.grad.abs().max().clamp_min(1e-12)
                assert (grads[k] - p.grad).abs().max() / scale <= 1e-5, (step, k)
            for opt in (opt_t, opt_o):
                opt.step()
                opt.zero_grad()
        state = adapter_peft_state(model, "qv", arch)
        for k, p in theirs.items():
            torch.testing.assert_close(state[k], p.detach(), rtol=1e-5, atol=1e-6)
    finally:
        remove_adapter(model, "qv")


def test_shared_a_import_of_an_adapter_with_its_own_a_per_projection_is_one_clear_error(base):
    arch, hf, model, d = base
    _peft_trained(hf, arch, "all-linear", d / "own-a", r=2)
    shared = LoRASpec(r=2, lora_alpha=4, target_modules="all-linear", shared_fused_a=True)
    with pytest.raises(ConfigError, match=r"k_proj.lora_A differs from q_proj.lora_A; with "
                                          r"lora.shared_fused_a"):
        import_peft_adapter(model, "y", d / "own-a", spec=shared)
    with pytest.raises(ConfigError, match=r"job.lora.r: the adapter in init_from has 2, the job 4"):
        import_peft_adapter(model, "y", d / "own-a", spec=LoRASpec(r=4, lora_alpha=4), where="job")


def test_export_names_its_base_or_says_what_to_pass(base, tmp_path):
    """An adapter of a model built from a HF directory names that directory (AutoPeftModel can load it); one
    of a model with no recorded base is one error naming base_model."""
    import json

    from lorafusion.layers import add_adapter
    from lorafusion.models.provider import build_model

    arch, _, model, d = base
    add_adapter(model, "z", LoRASpec(r=2, lora_alpha=2, target_modules=["v_proj"]))
    try:
        export_peft_adapter(model, "z", tmp_path / "z")
        cfg = json.loads((tmp_path / "z" / "adapter_config.json").read_text())
        assert (cfg["base_model_name_or_path"] == str((d / "base").resolve())
                and cfg["target_modules"] == ["v_proj"])
    finally:
        remove_adapter(model, "z")
    bare = build_model(arch, seed=0)
    add_adapter(bare, "z", LoRASpec(r=2, lora_alpha=2))
    with pytest.raises(ConfigError,
                       match="export_peft_adapter: base_model: expected the base model's HF name"):
        export_peft_adapter(bare, "z", tmp_path / "bare")
    assert not (tmp_path / "bare").exists()
