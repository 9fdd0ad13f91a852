"""Helpers for tests: tiny random HF checkpoints written to disk, and running HF models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lorafusion.core.arch import ModelArch, arch_to_hf_config


def hf_model_class(arch: ModelArch):
    import transformers

    return transformers.LlamaForCausalLM if arch.family == "llama" else transformers.Qwen2ForCausalLM


def hf_config(arch: ModelArch):
    import transformers

    cls = transformers.LlamaConfig if arch.family == "llama" else transformers.Qwen2Config
    cfg = arch_to_hf_config(arch)
    cfg.pop("model_type")
    cfg.pop("architectures")
    return cls(**cfg, attn_implementation="eager")


def write_hf_checkpoint(arch: ModelArch, path: Path, seed: int = 0, shards: int = 1):
    """Random-weight HF model saved as safetensors (``shards`` > 1 writes an index); returns the model."""
    torch.manual_seed(seed)
    model = hf_model_class(arch)(hf_config(arch)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    path.mkdir(parents=True, exist_ok=True)
    if shards > 1:
        model.save_pretrained(path, safe_serialization=True, max_shard_size=_shard_size(model, shards))
    else:
        model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch.family
    return model


def _shard_size(model, shards: int) -> str:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return f"{max(1, total // shards // 1000)}KB"
