"""Shared helpers for model tests: per-adapter losses on packed batches; recompute's interleaved
microbatches."""

from __future__ import annotations

import torch

from lorafusion.core.arch import preset
from lorafusion.core.lora import LoRASpec
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.data import pack_microbatch
from lorafusion.layers import add_adapter, lora_batch, lora_modules, set_batch


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


# tests/models/test_recompute.py and tests/layers/test_fp8_base.py: two microbatches interleaved as 1F1B does
RECOMPUTE_SPECS = {
    "a": LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",)),
    "b": LoRASpec(r=8, lora_alpha=8, lora_dropout=0.2,
                  target_modules=("q_proj", "k_proj", "v_proj", "down_proj")),
}


def tokens(seed, n, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def interleaved_grads(device, dtype, recompute: bool, layers: int | None = None) -> tuple[list[float], dict]:
    from lorafusion.models.provider import build_model

    arch = preset("tiny-llama")
    v = arch.vocab_size
    model = build_model(arch, params_dtype=dtype, recompute=recompute, recompute_layers=layers,
                        device=device, seed=3)
    for i, (name, spec) in enumerate(RECOMPUTE_SPECS.items()):
        add_adapter(model, name, spec, seed=i)
    randomize_b(model, seed=1)
    model.train()
    mbs = [pack_microbatch([("a", tokens(1, 37, v)), ("b", tokens(2, 21, v))], row_ids=[0, 1]),
           pack_microbatch([("b", tokens(3, 15, v)), ("a", tokens(4, 9, v)), ("b", tokens(5, 30, v))],
                           row_ids=[2, 3, 4])]
    losses = []
    for mb in mbs:
        b = mb.to(device)
        set_batch(model, b.routing, b.adapters, [adapter_seed(7, n) for n in b.adapters])
        per_token = model(b.tokens, b.position_ids, attention_mask=None, labels=b.labels,
                          packed_seq_params=b.packed_seq_params())
        losses.append((per_token.float() * b.loss_mask).sum() / b.loss_mask.sum())
    for loss in losses:  # backward of microbatch 1 while the routing in force is microbatch 2's
        loss.backward()
    set_batch(model, None, ())
    grads = {f"{key}.{p}.{n}": getattr(mod, p)[n].grad.detach().float().cpu().clone()
             for key, mod in lora_modules(model) for p in ("lora_A", "lora_B") for n in getattr(mod, p)}
    return [x.item() for x in losses], grads
