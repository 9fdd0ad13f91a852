"""Shared helpers for model tests: per-adapter losses on packed batches."""

from __future__ import annotations

import torch

from lorafusion.layers import lora_batch, lora_modules
from lorafusion.core.seeds import mix_seed, name_key


def adapter_seed(run_seed: int, name: str) -> int:
    return mix_seed(run_seed, name_key(name))


def per_token_loss(model, batch, run_seed: int = 7):
    """Megatron per-token CE loss [1, T] for a PackedBatch (routing + dropout seeds set)."""
    seeds = [adapter_seed(run_seed, n) for n in batch.adapters]
    with lora_batch(model, batch.routing, batch.adapters, seeds):
        return model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                     packed_seq_params=batch.packed_seq_params())


def adapter_losses(model, batch, run_seed: int = 7) -> dict[str, torch.Tensor]:
    """Token-mean loss per adapter over its tokens in this batch."""
    loss = per_token_loss(model, batch, run_seed)
    out = {}
    for name in batch.adapters:
        m = batch.adapter_token_mask(name).float() * batch.loss_mask
        out[name] = (loss * m).sum() / m.sum()
    return out


def lora_grads(model, name: str) -> dict[str, torch.Tensor]:
    g = {}
    for key, mod in lora_modules(model):
        if name in mod.lora_A:
            g[key + ".A"] = mod.lora_A[name].grad.clone()
            g[key + ".B"] = mod.lora_B[name].grad.clone()
    return g


def randomize_b(model, seed: int = 0, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for name in sorted(mod.lora_B):
                mod.lora_B[name].copy_(torch.randn(mod.lora_B[name].shape, generator=gen) * scale)
