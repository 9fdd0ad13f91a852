"""Packed RoPE: positions from cu_seqlens, cos/sin from Megatron's table, the rotation vs Megatron's thd
path (bit-identical for the torch impl) and vs the float64 reference (output and gradient), no host syncs,
and the megatron_patches dispatcher."""

import pytest
import torch

from lorafusion.models.fused.rope import (PackedRope, packed_positions, packed_rope, rope, rope_cos_sin,
                                          rope_reference)

from ._util import CPU_DTYPES, IMPLS, TOL, device, needs_cuda, rel

LENGTHS = [[5, 1, 9], [16], [3, 3, 2, 7]]


def _table(max_len, dim, dev, theta=10000.0):
    """Megatron's RotaryEmbedding.forward table: cat(f, f)[:, None, None, :] in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :].to(dev)


def _cu(lengths, dev):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)


def test_positions_restart_per_sample():
    from lorafusion.data.packing import pack_microbatch

    b = pack_microbatch([("a", list(range(5))), ("a", [1]), ("b", list(range(9)))])
    assert torch.equal(packed_positions(b.cu_seqlens, b.num_tokens), b.position_ids[0])


def _megatron_thd(x, freqs, cu):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.core import parallel_state

    return _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=parallel_state.get_context_parallel_group())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_torch_impl_is_megatron_bit_for_bit(megatron_single, dtype, lengths):
    cu = _cu(lengths, "cpu")
    x = torch.randn(sum(lengths), 4, 32).to(dtype)
    freqs = _table(max(lengths), 32, "cpu")
    assert torch.equal(packed_rope(x, freqs, cu, impl="torch"), _megatron_thd(x, freqs, cu))


def _check(impl, dtype, lengths, heads, dim, dev):
    g = torch.Generator().manual_seed(0)
    cu = _cu(lengths, dev)
    t = sum(lengths)
    cos, sin = rope_cos_sin(_table(max(lengths), dim, dev, theta=500000.0), packed_positions(cu, t))
    x0 = torch.randn(t, heads, dim, generator=g).to(dtype).to(dev)
    dy = torch.randn(t, heads, dim, generator=g).to(dtype).to(dev)
    x = x0.clone().requires_grad_(True)
    y = rope(x, cos, sin, impl=impl)
    y.backward(dy)
    xr = x0.double().requires_grad_(True)
    # the float64 reference uses the same cos/sin rounded to the activation dtype, as Megatron does
    ref = rope_reference(xr, cos.to(dtype).double(), sin.to(dtype).double())
    ref.backward(dy.double())
    assert y.dtype == dtype
    assert rel(y, ref) <= TOL[dtype], (impl, dtype, rel(y, ref))
    assert rel(x.grad, xr.grad) <= TOL[dtype], (impl, dtype, rel(x.grad, xr.grad))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("lengths,heads,dim", [([5, 1, 9], 4, 32), ([16], 3, 16), ([3, 3, 2, 7], 6, 24)])
def test_matches_float64_reference(impl, dtype, lengths, heads, dim):
    _check(impl, dtype, lengths, heads, dim, device())


def test_triton_accepts_strided_heads():
    """q/k arrive as views of the fused qkv projection (head stride ≠ head dim)."""
    cu = _cu([4, 6], "cpu")
    cos, sin = rope_cos_sin(_table(6, 16, "cpu"), packed_positions(cu, 10))
    qkv = torch.randn(10, 2, 3 * 16)
    q = qkv.view(10, 2, 3, 16)[:, :, 0]
    assert torch.allclose(rope(q, cos, sin, impl="triton"), rope_reference(q, cos, sin), atol=1e-6, rtol=0)


def test_no_host_sync(monkeypatch):
    """The packed path never reads device values on the host (Megatron's thd path does, per call)."""
    cu = _cu([5, 1, 9], "cpu")
    x = torch.randn(15, 2, 16)
    freqs = _table(9, 16, "cpu")

    def refuse(*a, **k):
        raise AssertionError("host sync")

    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = packed_rope(x, freqs, cu, impl="torch")
    with pytest.raises(AssertionError, match="host sync"):
        _megatron_thd(x, freqs, cu)
    monkeypatch.undo()
    assert out.shape == x.shape


def test_cos_sin_built_once_per_microbatch():
    cu = _cu([3, 4], "cpu")
    freqs = _table(4, 8, "cpu")
    a = PackedRope.for_microbatch(freqs, cu, 7)
    assert PackedRope.for_microbatch(freqs, cu, 7) is a
    assert PackedRope.for_microbatch(freqs, _cu([3, 4], "cpu"), 7) is not a  # a new microbatch
    assert PackedRope.for_microbatch(_table(4, 8, "cpu"), cu, 7) is not a  # a new table


def test_dispatcher_only_for_models_that_ask(megatron_single):
    import megatron.core.transformer.attention as attention

    from megatron_patches import apply_packed_rope_patch, packed_rope_patch_applied
    from lorafusion.core.arch import preset
    from lorafusion.models.spec import transformer_config

    apply_packed_rope_patch(packed_rope)
    fn = attention.apply_rotary_pos_emb
    apply_packed_rope_patch(packed_rope)
    assert packed_rope_patch_applied() and attention.apply_rotary_pos_emb is fn  # idempotent
    cfg = transformer_config(preset("tiny-llama"))
    cu = _cu([5, 3], "cpu")
    x = torch.randn(8, 2, 8)
    freqs = _table(5, 8, "cpu")
    plain = fn(x, freqs, cfg, cu_seqlens=cu)  # packed_rope_impl None: Megatron's own function
    cfg.packed_rope_impl = "triton"
    fused = fn(x, freqs, cfg, cu_seqlens=cu)
    assert torch.allclose(plain, fused, atol=1e-6, rtol=0)
    assert hasattr(cu, "_lorafusion_packed_rope")  # went through the packed path


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lengths,heads", [([4000, 12000, 384], 32), ([17, 1, 300], 8)])
def test_bf16_gpu(impl, lengths, heads):
    _check(impl, torch.bfloat16, lengths, heads, 128, "cuda")
