"""model.attention: which packed attention a process runs (models/attention.py select_attention). auto never
picks an implementation that is not installed or fails its start-up check; an explicit one that cannot run is
one ConfigError naming model.attention and what to do. The GPU itself is faked where the logic, not a kernel,
is under test; FlashAttention-4 against float64 on a real GPU is in test_packed_attention.py."""


import pytest
import torch

from lorafusion.core.errors import ConfigError
from lorafusion.models import attention as att

SHAPE = dict(heads=4, groups=2, head_dim=16)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(att, "_SELECTED", None)
    monkeypatch.setattr(att, "_VARLEN_FAILED", False)


def _fake_gpu(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(att, "_gpu", lambda: (torch.device("cpu"), capability))


def _select(setting, dtype=torch.bfloat16):
    return att.select_attention(setting, **SHAPE, dtype=dtype, where="run.yaml: model.attention")


def _fa4_installed() -> bool:
    try:
        att._fa4_fn()
    except Exception:
        return False
    return True


def test_without_a_gpu_auto_is_the_exact_per_sample_path():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _select("auto") == "per-sample" and att.selected() == "per-sample"
    for setting in ("fa4", "fa2"):
        with pytest.raises(ConfigError, match=f"run.yaml: model.attention: {setting} needs a CUDA GPU"):
            _select(setting)


def test_auto_skips_flashattention4_when_it_is_not_installed(monkeypatch):
    if _fa4_installed():
        pytest.skip("flash-attn-4 is installed here")
    _fake_gpu(monkeypatch)
    checked = []
    monkeypatch.setattr(att, "probe", lambda name, *a: checked.append(name))  # every check passes
    assert _select("auto") == att.attention_path() and att.selected() == "fa2"
    assert checked == ["fa2"]  # fa4 was never run: it does not import


def test_an_explicit_fa4_that_is_not_installed_says_how_to_install_it(monkeypatch):
    if _fa4_installed():
        pytest.skip("flash-attn-4 is installed here")
    _fake_gpu(monkeypatch)
    with pytest.raises(ConfigError) as e:
        _select("fa4")
    msg = str(e.value)
    assert msg.startswith("run.yaml: model.attention: fa4 cannot run here: flash-attn-4 is not installed")
    assert "pip install 'lorafusion[fa4]'" in msg and "\n" not in msg


def test_auto_takes_fa4_when_it_imports_and_passes_its_check(monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(att, "_FA4", lambda *a, **kw: None)  # "installed"
    monkeypatch.setattr(att, "probe", lambda name, *a: None)
    assert _select("auto") == "fa4" and att.attention_path() == "fa4"


def test_auto_skips_an_installed_fa4_that_fails_its_check_with_a_warning(monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(att, "_FA4", lambda *a, **kw: None)
    monkeypatch.setattr(att, "probe", lambda name, *a: "its dq is off by 0.5" if name == "fa4" else None)
    with pytest.warns(UserWarning, match="auto: fa4 failed its start-up check .its dq is off by 0.5"):
        assert _select("auto") in ("varlen", "varlen-gqa")
    assert att.selected() == "fa2"
    with pytest.raises(ConfigError, match="model.attention: fa4 cannot run here: its dq is off by 0.5; use"):
        _select("fa4")


def test_auto_falls_to_per_sample_when_nothing_passes(monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(att, "_FA4", lambda *a, **kw: None)
    monkeypatch.setattr(att, "probe", lambda name, *a: "RuntimeError: no kernel")
    with pytest.warns(UserWarning):
        assert _select("auto") == "per-sample"


def test_fa4_is_not_tried_on_a_gpu_older_than_hopper(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0))
    monkeypatch.setattr(att, "_FA4", lambda *a, **kw: None)
    checked = []
    monkeypatch.setattr(att, "probe", lambda name, *a: checked.append(name))
    assert _select("auto") in ("varlen", "varlen-gqa") and checked == ["fa2"]
    with pytest.raises(ConfigError, match="fa4 cannot run here: FlashAttention-4 trains on Hopper .* sm_80"):
        _select("fa4")


def test_float32_runs_per_sample_and_refuses_the_16_bit_kernels(monkeypatch):
    _fake_gpu(monkeypatch)
    assert _select("auto", torch.float32) == "per-sample"
    with pytest.raises(ConfigError, match="model.attention: fa2 needs model.dtype bfloat16 or float16"):
        _select("fa2", torch.float32)


def test_the_check_catches_a_wrong_implementation_and_passes_a_right_one(monkeypatch):
    """probe compares output and dq, dk, dv with the fp32 reference (here an implementation on the CPU)."""
    def right(q, k, v, cu, max_seqlen, scale):
        return att.varlen_attention_reference(q, k, v, cu, scale)

    def no_scale(q, k, v, cu, max_seqlen, scale):
        return att.varlen_attention_reference(q, k, v, cu, 1.0)

    def broken(*a):
        raise AssertionError("head_dim must be a multiple of 8")

    args = (*SHAPE.values(), torch.float32, torch.device("cpu"))
    for impl, want in ((right, None), (no_scale, "off by"), (broken, "AssertionError: head_dim")):
        monkeypatch.setitem(att._RUN, "fa4", impl)
        got = att.probe("fa4", *args)
        assert got is None if want is None else want in got


def test_fa4_gets_the_packed_grouped_inputs_as_its_api_takes_them(monkeypatch):
    """flash_attn.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=,
    max_seqlen_k=, softmax_scale=, causal=) -> (out, lse): k and v stay grouped, causal, the given scale."""
    seen = {}

    def fake(q, k, v, **kw):
        seen.update(kw, k_heads=k.shape[1])
        cu = kw["cu_seqlens_q"]
        return att.varlen_attention_reference(q, k, v, cu, kw["softmax_scale"]), torch.zeros(q.shape[1], 9)

    monkeypatch.setattr(att, "_FA4", fake)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = att.fa4_attention(q, k, v, cu, 5, 0.25)
    assert seen["k_heads"] == 2 and seen["causal"] is True and seen["softmax_scale"] == 0.25
    assert seen["cu_seqlens_k"] is cu and seen["max_seqlen_q"] == seen["max_seqlen_k"] == 5
    torch.testing.assert_close(out, att.varlen_attention_reference(q, k, v, cu, 0.25))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_train_refuses_an_attention_this_machine_cannot_run_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-m", "lorafusion.cli", "train", "configs/quickstart.yaml",
                          "model.attention=fa4", f"output_dir={tmp_path / 'run'}"], cwd=root, timeout=300,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "configs/quickstart.yaml: model.attention: fa4 needs a CUDA GPU" in last
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


class _SavesLikeFa4(torch.autograd.Function):
    """What flash_attn.cute's FlashAttnVarlenFunc keeps for backward (its interface.py:
    ctx.save_for_backward(q, k, v, ..., out, lse, ..., cu_seqlens_q, cu_seqlens_k)), the math by the
    reference."""

    @staticmethod
    def forward(ctx, q, k, v, cu, scale):
        out = att.varlen_attention_reference(q, k, v, cu, scale)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, cu, cu)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, None, None, None, None


def test_fa4_keeps_what_the_memory_model_counts_and_not_qkvs_output(monkeypatch):
    """v arrives as a view of qkv's output (Megatron's split), q and k rotated (new tensors): the saved set is
    q, k, a copy of v, the output and the log-sum-exp — attention_elems("fa4") — not the whole qkv output."""
    from dataclasses import replace

    from lorafusion.core.arch import preset
    from lorafusion.scheduler.memory import AdapterShape, MemorySetup, attention_elems

    monkeypatch.setattr(att, "_FA4", lambda q, k, v, **kw: _SavesLikeFa4.apply(
        q, k, v, kw["cu_seqlens_q"], kw["softmax_scale"]))
    arch = preset("tiny-llama")
    h, g, d, t = arch.num_attention_heads, arch.num_query_groups, arch.kv_channels, 12
    qkv = torch.randn(t, g, (h // g + 2) * d, dtype=torch.bfloat16, requires_grad=True)
    q = qkv[..., :h // g * d].reshape(t, h, d) * 1.0
    k, v = qkv[..., h // g * d:(h // g + 1) * d] * 1.0, qkv[..., (h // g + 1) * d:]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kept: dict[int, int] = {}

    def pack(x):
        kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        att.fa4_attention(q, k, v, cu, 7, 0.125)
    kept.pop(cu.untyped_storage().data_ptr())
    assert qkv.untyped_storage().data_ptr() not in kept
    setup = replace(MemorySetup(arch, (AdapterShape(8),), dtype="bfloat16"), attention="fa4")
    assert sum(kept.values()) / 2 / t == attention_elems(setup)
