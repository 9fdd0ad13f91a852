"""FP8 frozen base in the model (model.base_precision: fp8, lorafusion.layers.fp8_base): which linears are
built with an FP8 base (and hold no bf16 copy), the LoRA linear's output and gradients = FP8 base + the
unchanged LoRA term, recompute, HF import, and the whole model against its bf16 twin. On CPU through
torch._scaled_mm."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_utils import write_hf_checkpoint
from lorafusion.core.arch import ModelArch, preset
from lorafusion.core.lora import LoRASpec
from lorafusion.data import pack_microbatch
from lorafusion.layers import add_adapter, lora_batch, lora_modules
from lorafusion.layers.fp8_base import BF16_LEADING_LAYERS, is_fp8
from lorafusion.layers.inject import base_weight_bytes
from lorafusion.models.provider import build_model
from lorafusion.ops import fp8_linear as F
from model_utils import adapter_losses, interleaved_grads, lora_grads, randomize_b

SPEC = LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",))


def _model(precision, arch=None, **kw):
    model = build_model(arch or preset("tiny-llama"), params_dtype=torch.bfloat16, seed=11,
                        base_precision=precision, **kw)
    add_adapter(model, "a", SPEC, seed=3)
    add_adapter(model, "b",
                LoRASpec(r=8, lora_alpha=8,
                         target_modules=("q_proj", "k_proj", "v_proj", "down_proj")), seed=3)
    randomize_b(model, seed=5)
    return model.train()


def _batch(vocab=512):
    tok = lambda s, n: torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(s)).tolist()  # noqa: E731
    return pack_microbatch([("a", tok(1, 40)), ("b", tok(2, 23)), ("a", tok(3, 17))], row_ids=[0, 1, 2])


def test_every_decoder_linear_but_the_first_layers_is_fp8_and_its_bf16_copy_is_gone(megatron_single):
    bf16, fp8 = _model("bf16"), _model("fp8")
    mods = dict(lora_modules(fp8))
    assert len(mods) == 4 * 4  # qkv, proj, fc1, fc2 of 4 layers
    keep = BF16_LEADING_LAYERS
    assert keep == 1  # the shipped default: the first layer stays bf16 (docs/BENCHMARKS.md, FP8 quality)
    for key, mod in mods.items():
        assert mod.base_precision == ("bf16" if mod.layer_number <= keep else "fp8"), key
        if mod.layer_number <= keep:
            assert mod.weight is not None and mod.weight.dtype == torch.bfloat16 and not is_fp8(mod), key
            assert torch.equal(mod.weight, dict(lora_modules(bf16))[key].weight)
            continue
        assert mod.weight is None, key
        assert mod.weight_fp8.dtype == torch.float8_e4m3fn and mod.weight_scale.dtype == torch.float32
        assert mod.weight_fp8.shape == dict(lora_modules(bf16))[key].weight.shape
    # one byte per weight plus a float32 scale per output channel: about half the bf16 bytes (FP8 layers), and
    # the kept layer's bf16 bytes
    ref = dict(lora_modules(bf16))
    fp8_bytes = sum(m.weight_fp8.numel() + 4 * m.weight_scale.numel() for m in mods.values() if is_fp8(m))
    bf16_bytes = sum(2 * ref[k].weight.numel() for k, m in mods.items() if is_fp8(m))
    assert 0.5 < fp8_bytes / bf16_bytes < 0.55, fp8_bytes / bf16_bytes
    kept = sum(2 * m.weight.numel() for m in mods.values() if not is_fp8(m))
    assert base_weight_bytes(fp8) == fp8_bytes + kept
    # the FP8 base is never checkpointed (the kept bf16 layer's weights are parameters)
    state = fp8.state_dict()
    assert not any(k.endswith(("weight_fp8", "weight_scale")) for k in state)
    assert not any(k.endswith(("linear_qkv.weight", "linear_fc2.weight"))
                   and not k.startswith("decoder.layers.0.")
                   for k in state), [k for k in state if k.endswith("linear_qkv.weight")]
    assert (fp8.output_layer.weight.dtype == torch.bfloat16
            and fp8.embedding.word_embeddings.weight.dtype == torch.bfloat16)
    assert fp8.config.base_precision == "fp8" and bf16.config.base_precision == "bf16"
    # the quantized weights are the bf16 ones to e4m3's precision
    for key, mod in mods.items():
        if not is_fp8(mod):
            continue
        w = dict(lora_modules(bf16))[key].weight.detach().double()
        torch.testing.assert_close(F.dequantize(mod.weight_fp8, mod.weight_scale), w, rtol=2 ** -4,
                                   atol=float(mod.weight_scale.max()) * 2 ** -9)
    with pytest.raises(ValueError, match="base_precision: expected one of"):
        build_model(preset("tiny-llama"), params_dtype=torch.bfloat16, base_precision="fp4")


def test_the_config_says_how_many_leading_layers_stay_bf16(megatron_single):
    bf16 = _model("bf16")
    batch = _batch()
    want = adapter_losses(bf16, batch)
    kept = _model("fp8", fp8_bf16_layers=4)  # every layer kept: the bf16 model, bit for bit
    assert kept.config.fp8_bf16_layers == 4 and not any(is_fp8(mod) for _, mod in lora_modules(kept))
    got = adapter_losses(kept, batch)
    assert {k: v.item() for k, v in got.items()} == {k: v.item() for k, v in want.items()}
    model = _model("fp8", fp8_bf16_layers=1)
    assert sum(is_fp8(mod) for _, mod in lora_modules(model)) == 12
    for key, mod in lora_modules(model):
        first = key.startswith("1.")
        assert (mod.weight is not None) == first and (getattr(mod, "weight_fp8", None) is None) == first, key
    losses = adapter_losses(model, batch)
    sum(losses.values()).backward()
    assert all(torch.isfinite(g).all() for g in lora_grads(model, "a").values())
    assert all(v.item() != want[k].item() for k, v in losses.items())  # the other layers are FP8
    every = _model("fp8", fp8_bf16_layers=0)
    assert all(mod.weight is None and is_fp8(mod) for _, mod in lora_modules(every))
    assert [k for k, _ in every.named_parameters() if k.endswith(".weight") and "linear_" in k] == []


def test_lora_linear_is_the_fp8_base_plus_the_unchanged_lora_term(megatron_single):
    model = _model("fp8")
    batch = _batch()
    T = batch.tokens.numel()
    with lora_batch(model, batch.routing, batch.adapters, [7, 9]):
        for key, mod in [kv for kv in lora_modules(model) if is_fp8(kv[1])]:
            x = torch.randn(T, 1, mod.input_size,
                            generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            out, _ = mod(x1)
            base = F.fp8_linear(x2, mod.weight_fp8, mod.weight_scale)
            want = base + mod._lora_delta(x2, mod._lora_args(x2))
            assert torch.equal(out, want), key
            dy = torch.randn_like(out)
            names = sorted(mod.lora_A)
            got = torch.autograd.grad(out,
                                      [x1, *[mod.lora_A[n] for n in names],
                                       *[mod.lora_B[n] for n in names]], dy)
            ref = torch.autograd.grad(want,
                                      [x2, *[mod.lora_A[n] for n in names],
                                       *[mod.lora_B[n] for n in names]], dy)
            for g, r in zip(got, ref):
                assert torch.equal(g, r), key


def test_fp8_model_trains_like_its_bf16_twin(megatron_single):
    batch = _batch()
    out = {}
    for precision in ("bf16", "fp8"):
        model = _model(precision)
        losses = adapter_losses(model, batch)
        sum(losses.values()).backward()
        out[precision] = ({k: v.item() for k, v in losses.items()},
                          {n: lora_grads(model, n) for n in ("a", "b")})
    (l16, g16), (l8, g8) = out["bf16"], out["fp8"]
    for n in l16:
        assert l8[n] == pytest.approx(l16[n], rel=0.02)
        for k in g16[n]:
            cos = torch.nn.functional.cosine_similarity(g8[n][k].flatten().double(),
                                                        g16[n][k].flatten().double(), dim=0)
            assert cos > 0.85, (n, k, cos)  # a tiny random model: see docs/BENCHMARKS.md for the 8B shape


def test_recompute_with_fp8_base_equals_no_recompute(megatron_single, monkeypatch):
    import lorafusion.models.provider as P

    monkeypatch.setattr(P, "build_model", functools.partial(P.build_model, base_precision="fp8"))
    want_losses, want = interleaved_grads("cpu", torch.bfloat16, recompute=False)
    got_losses, got = interleaved_grads("cpu", torch.bfloat16, recompute=True)
    assert got_losses == want_losses
    assert got.keys() == want.keys() and want
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_hf_import_quantizes_the_loaded_weights(tmp_path, megatron_single):
    from lorafusion.models.hf_import import build_model_from_hf

    arch = ModelArch(family="qwen2", vocab_size=150, hidden_size=64, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=96, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6)
    write_hf_checkpoint(arch, tmp_path / "hf", seed=4)
    bf16 = build_model_from_hf(tmp_path / "hf", params_dtype=torch.bfloat16)
    fp8 = build_model_from_hf(tmp_path / "hf", params_dtype=torch.bfloat16, base_precision="fp8")
    ref = dict(lora_modules(bf16))
    assert [is_fp8(mod) for _, mod in lora_modules(fp8)] == [False] * 4 + [True] * 4  # layer 1 kept in bf16
    for key, mod in lora_modules(fp8):
        if not is_fp8(mod):
            assert torch.equal(mod.weight, ref[key].weight)
            continue
        assert mod.weight is None
        w = ref[key].weight.detach().double()
        torch.testing.assert_close(F.dequantize(mod.weight_fp8, mod.weight_scale), w, rtol=2 ** -4,
                                   atol=float(mod.weight_scale.max()) * 2 ** -9)
        if mod.bias is not None:  # qkv bias (qwen2) stays in bf16, added after the FP8 GEMM
            assert torch.equal(mod.bias, ref[key].bias)
    tokens = torch.arange(1, 30).view(1, -1)
    pos = torch.arange(29).view(1, -1)
    with torch.no_grad():
        a = bf16(tokens, pos, attention_mask=None).float()
        b = fp8(tokens, pos, attention_mask=None).float()
    assert float((a - b).norm() / a.norm()) < 0.1


def test_odd_hidden_sizes_take_the_fallback(megatron_single):
    arch = ModelArch(family="llama", vocab_size=101, hidden_size=90, num_layers=2, num_attention_heads=5,
                     num_query_groups=5, ffn_hidden_size=130, max_position_embeddings=128)
    model = _model("fp8", arch=arch)
    losses = adapter_losses(model, _batch(vocab=101))
    sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())
    assert all(torch.isfinite(g).all() for g in lora_grads(model, "a").values())


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs an sm_89+ GPU")
def test_cuda_fp8_base_with_the_fused_lora_kernels_equals_the_torch_lora_path(megatron_single):
    """Per LoRA linear (the FP8 base term is the same op in both): output and every gradient with the Triton
    LoRA kernels equal the torch LoRA path to bf16 precision. (Through a whole FP8 model the two differ by FP8
    rounding flips, which a bf16-sized change of an input can cause: the whole-model comparison is the bench's
    losses.)"""
    from lorafusion.layers import get_lora_context

    dev = torch.device("cuda")
    model = build_model(preset("tiny-llama"), params_dtype=torch.bfloat16, seed=11,
                        base_precision="fp8", device=dev)
    add_adapter(model, "a", SPEC, seed=3)
    add_adapter(model, "b",
                LoRASpec(r=8, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj")),
                seed=3)
    randomize_b(model, seed=5)
    model.train()
    batch = _batch().to(dev)
    T = batch.tokens.numel()
    with lora_batch(model, batch.routing, batch.adapters, [7, 9]):
        for key, mod in [kv for kv in lora_modules(model) if is_fp8(kv[1])]:
            x = torch.randn(T, 1, mod.input_size, device=dev, generator=torch.Generator(dev).manual_seed(1))
            dy = torch.randn(T, 1, mod.weight_fp8.shape[0], device=dev,
                             generator=torch.Generator(dev).manual_seed(2))
            names = sorted(mod.lora_A)
            res = {}
            for impl in ("fused", "reference"):
                get_lora_context(model).impl = impl
                xi = x.to(torch.bfloat16).requires_grad_(True)
                out, _ = mod(xi)
                params = [xi, *[mod.lora_A[n] for n in names], *[mod.lora_B[n] for n in names]]
                res[impl] = (out, *torch.autograd.grad(out, params, dy.to(torch.bfloat16)))
            for got, want in zip(res["fused"], res["reference"]):
                err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
                assert err < 2e-2, (key, err)


def test_fused_kernels_take_the_one_op_fp8_path_and_equal_the_torch_lora_path(megatron_single, monkeypatch):
    """With the Triton LoRA kernels (interpreter on CPU) and no TP, each FP8 LoRA linear is one op (the LoRA
    term added into the FP8 GEMM's output) and equals the split torch path: output and every gradient. (One
    column-parallel fused linear and one row-parallel; float16 and odd shapes: tests/ops/test_fp8_lora.py.)"""
    from lorafusion.layers import get_lora_context
    from lorafusion.ops import fp8_lora

    dtype = torch.float32
    calls = []
    real = fp8_lora.fp8_multi_lora_linear
    monkeypatch.setattr(fp8_lora, "fp8_multi_lora_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build_model(preset("tiny-llama"), params_dtype=dtype, seed=11, base_precision="fp8")
    add_adapter(model, "a", SPEC, seed=3)
    add_adapter(model, "b",
                LoRASpec(r=8, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj")),
                seed=3)
    randomize_b(model, seed=5)
    model.train()
    batch = _batch()
    T = batch.tokens.numel()
    tol = 1e-5
    seen = []
    with lora_batch(model, batch.routing, batch.adapters, [7, 9]):
        for key, mod in [kv for kv in lora_modules(model) if kv[0] in ("2.linear_qkv", "2.linear_fc2")]:
            x = torch.randn(T, 1, mod.input_size, generator=torch.Generator().manual_seed(1)).to(dtype)
            dy = torch.randn(T, 1, mod.weight_fp8.shape[0],
                             generator=torch.Generator().manual_seed(2)).to(dtype)
            names = sorted(mod.lora_A)
            res = {}
            for impl in ("triton", "torch"):
                get_lora_context(model).impl = impl
                n0 = len(calls)
                xi = x.clone().requires_grad_(True)
                out, _ = mod(xi)
                assert len(calls) == n0 + (impl == "triton"), key
                params = [xi, *[mod.lora_A[n] for n in names], *[mod.lora_B[n] for n in names]]
                res[impl] = (out.detach(), *torch.autograd.grad(out, params, dy))
            seen.append(key)
            for got, want in zip(res["triton"], res["torch"], strict=True):
                err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
                assert err < tol, (key, err)
    assert seen == ["2.linear_qkv", "2.linear_fc2"], seen


@pytest.mark.parametrize("keep", [False, True], ids=["transpose_per_call", "transpose_kept"])
def test_the_weight_form_follows_the_weight_when_it_is_rewritten(megatron_single, monkeypatch, keep):
    """A linear's FP8 weight form (operand views, scale rows and, when kept, W_q's transpose) is made once and
    reused; rewriting the weight (write_base_tensor, an in-place write, a replaced buffer) remakes it: each
    call then gives what a form made from scratch gives, through the torch and the one-op Triton path."""
    from lorafusion.layers import fp8_base, get_lora_context

    monkeypatch.setattr(fp8_base, "KEEP_TRANSPOSED", keep)
    model = build_model(preset("tiny-llama"), params_dtype=torch.float32, seed=11, base_precision="fp8")
    add_adapter(model, "a", SPEC, seed=3)
    add_adapter(model, "b", LoRASpec(r=8, lora_alpha=8, target_modules=("down_proj",)), seed=3)
    randomize_b(model, seed=5)
    model.train()
    batch = _batch()
    T = batch.tokens.numel()
    mod = dict(lora_modules(model))["2.linear_fc2"]
    x = torch.randn(T, 1, mod.input_size, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(T, 1, mod.weight_fp8.shape[0], generator=torch.Generator().manual_seed(2))

    def run():
        xi = x.clone().requires_grad_(True)
        out, _ = mod(xi)
        return out.detach(), *torch.autograd.grad(out, [xi], dy.to(out.dtype))

    def from_scratch():
        mod.__dict__.pop("_fp8_form", None)
        return run()

    g = torch.Generator().manual_seed(9)
    with lora_batch(model, batch.routing, batch.adapters, [7, 9]):
        for impl in ("torch", "triton"):
            get_lora_context(model).impl = impl
            before = run()
            form = fp8_base.weight_form(mod)
            assert fp8_base.weight_form(mod) is form and (form.dx_b is not None) == keep
            fp8_base.write_base_tensor(mod, "weight", torch.randn(mod.weight_fp8.shape, generator=g) * 0.05)
            got = run()
            assert fp8_base.weight_form(mod) is not form
            want = from_scratch()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), impl
            assert not torch.equal(got[0], before[0]) and not torch.equal(got[1], before[1])
            with torch.no_grad():  # written in place by other code
                mod.weight_fp8.copy_(F.quantize_weight(torch.randn(mod.weight_fp8.shape, generator=g))[0])
            got = run()
            assert all(torch.equal(a, b) for a, b in zip(got, from_scratch())), impl
            mod.weight_scale = mod.weight_scale * 2  # the buffer replaced
            got = run()
            assert all(torch.equal(a, b) for a, b in zip(got, from_scratch())), impl
