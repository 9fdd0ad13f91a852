"""Full activation recomputation with LoRA routing, interleaved as 1F1B does it: forward of microbatch 1,
forward of microbatch 2 (the model's routing is now 2's), then backward of 1 — whose recompute must run with
1's routing, restored by the hook in ``megatron_patches.recompute``. On CUDA this is the path of the 70B PP=4
crash: the fused kernels, their device tables and packer row ids (numpy) in the routing."""

import pytest
import torch

from lorafusion.core.arch import preset
from lorafusion.data import pack_microbatch
from lorafusion.layers import add_adapter, set_batch
from model_utils import RECOMPUTE_SPECS, adapter_seed, interleaved_grads, tokens


def _check(device, dtype, tol, layers=None):
    want_losses, want = interleaved_grads(device, dtype, recompute=False)
    got_losses, got = interleaved_grads(device, dtype, recompute=True, layers=layers)
    assert got_losses == pytest.approx(want_losses, rel=tol)
    assert got.keys() == want.keys() and len(want) > 0
    for k in want:
        assert torch.isfinite(got[k]).all(), k
        err = ((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item()
        assert err <= tol, (k, err)


@pytest.mark.parametrize("layers", [None, 1])
def test_recompute_interleaved_microbatches_equal_no_recompute_cpu(megatron_single, layers):
    """Every layer recomputed, or (``model.recompute_layers: 1``) the first of tiny-llama's four."""
    _check("cpu", torch.float32, 1e-6, layers)


@pytest.mark.parametrize("layers,checkpointed", [(None, 4), (1, 1), (3, 3)])
def test_recompute_layers_checkpoints_the_first_n_layers_of_the_stage(megatron_single, monkeypatch, layers,
                                                                       checkpointed):
    import lorafusion.layers.lora_linear as ll
    from lorafusion.core.errors import ConfigError
    from lorafusion.models.provider import build_model
    from megatron_patches import apply_recompute_state_hook

    calls = []

    def capture():
        calls.append(1)
        return ll.capture_routing()

    model = build_model(preset("tiny-llama"), recompute=True, recompute_layers=layers, seed=3)
    apply_recompute_state_hook(capture, ll.restore_routing)  # counts the checkpointed forwards
    try:
        add_adapter(model, "a", RECOMPUTE_SPECS["a"], seed=0)
        mb = pack_microbatch([("a", tokens(1, 12, 64))], row_ids=[0])
        set_batch(model, mb.routing, mb.adapters, [adapter_seed(7, "a")])
        model.train()
        model(mb.tokens, mb.position_ids, attention_mask=None, labels=mb.labels,
              packed_seq_params=mb.packed_seq_params())
        set_batch(model, None, ())
    finally:
        apply_recompute_state_hook(ll.capture_routing, ll.restore_routing)
    assert len(calls) == checkpointed  # one checkpointed forward per recomputed layer (tiny-llama has 4)
    with pytest.raises(ConfigError, match="recompute_layers: 5 is more than the 4 decoder layers"):
        build_model(preset("tiny-llama"), recompute=True, recompute_layers=5)
    with pytest.raises(ConfigError, match="needs model.recompute: true"):
        build_model(preset("tiny-llama"), recompute=False, recompute_layers=1)


def test_recompute_without_the_routing_restore_is_caught(megatron_single, monkeypatch):
    """The comparison above is sensitive: with the restore hook doing nothing, recompute of microbatch 1
    runs with microbatch 2's routing and the test's check fails."""
    import lorafusion.layers.lora_linear as ll
    import lorafusion.models.provider as P

    monkeypatch.setattr(P, "restore_routing", lambda state: None)  # what build_model(recompute=True) installs
    try:
        with pytest.raises((AssertionError, RuntimeError, ValueError)):
            _check("cpu", torch.float32, 1e-6)
    finally:  # put the real hook back for models built before this test
        from megatron_patches import apply_recompute_state_hook

        monkeypatch.undo()
        apply_recompute_state_hook(ll.capture_routing, ll.restore_routing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recompute_interleaved_microbatches_equal_no_recompute_gpu_bf16(megatron_single):
    """bf16, fused Triton LoRA kernels and fused ops (the GPU defaults): recompute re-runs the same kernels
    on the same inputs, so the two agree to bf16 rounding of the loss reduction order at most."""
    _check("cuda", torch.bfloat16, 2e-2)
