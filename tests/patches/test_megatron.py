"""megatron_patches: explicit, idempotent CPU shims; a 2-layer GPT trains a step on CPU."""

import subprocess
import sys

import torch

import megatron_patches as megatron_patches


def test_patches_apply_idempotently(megatron_single):
    assert megatron_patches.apply_cpu_patches() is True
    assert megatron_patches.apply_cpu_patches() is True
    assert megatron_patches.cpu_patches_applied()
    assert torch.cuda.current_device() == torch.device("cpu")


def test_no_patch_when_cuda_is_present():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "import megatron_patches as megatron_patches\n"
        "assert megatron_patches.apply_cpu_patches() is False\n"
        "assert torch.cuda.current_device is orig and not megatron_patches.cpu_patches_applied()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_two_layer_gpt_trains_a_step_on_cpu(megatron_single):
    """Full-parameter step through Megatron's no-pipelining schedule: RNG tracker, schedules, optimizer."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from lorafusion.core.arch import preset
    from lorafusion.layers import LoRAContext
    from lorafusion.models.layer_spec import lora_block_spec
    from lorafusion.models.spec import transformer_config

    arch = preset("tiny-llama", num_layers=2)
    cfg = transformer_config(arch, hidden_dropout=0.1, perform_initialization=True)
    model = GPTModel(config=cfg, transformer_layer_spec=lora_block_spec(cfg, LoRAContext()),
                     vocab_size=arch.vocab_size,
                     max_sequence_length=64, position_embedding_type="rope")
    with get_cuda_rng_tracker().fork():  # the tracker works on the CPU generator
        torch.rand(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        def forward_step(it, m):
            out = m(ids, torch.arange(16)[None].expand(2, -1), attention_mask=None, labels=ids.roll(-1, 1))
            return out, lambda o: (o.mean(), torch.tensor(1, dtype=torch.int), {"loss": o.mean().detach()})

        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]),
                                             model=[model], num_microbatches=1, seq_length=16,
                                             micro_batch_size=2)
        opt.step()
        opt.zero_grad()
        return losses[0]["loss"].item()

    model.train()
    first = step()
    for _ in range(3):
        last = step()
    assert last < first
