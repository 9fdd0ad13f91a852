"""lorafusion model → HF LLaMA / Qwen2 checkpoint directory (the inverse of
:mod:`lorafusion.models.hf_import`).

:func:`hf_state_from_model` maps a whole model (TP = 1, PP = 1) to HF tensor names: ``linear_qkv`` is split
back into q/k/v with :func:`~lorafusion.models.hf_layout.qkv_split`, ``linear_fc1`` into gate/up.
:func:`write_hf_weights` writes (name, tensor) pairs as ``model.safetensors``, or as shards plus
``model.safetensors.index.json`` once they exceed ``max_shard_bytes``, one shard in memory at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorafusion.core.arch import ModelArch
from lorafusion.models.hf_layout import qkv_split

DEFAULT_SHARD_BYTES = 5 * 1024**3  # transformers' save_pretrained default


def hf_state_from_model(model: torch.nn.Module, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every base weight of a whole model (built with TP = 1 and PP = 1)."""
    from megatron.core import parallel_state  # (here only: export writes with this module before any model)

    if parallel_state.get_tensor_model_parallel_world_size() != 1 or not (
            getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("hf_state_from_model needs the whole model (tp = 1, pp = 1)")
    own = model.state_dict()
    yield "model.embed_tokens.weight", own["embedding.word_embeddings.weight"]
    for local, layer in enumerate(model.decoder.layers):
        i = layer.layer_number - 1
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        yield p + "input_layernorm.weight", own[m + "input_layernorm.weight"]
        q, k, v = qkv_split(own[m + "self_attention.linear_qkv.weight"], arch)
        yield p + "self_attn.q_proj.weight", q
        yield p + "self_attn.k_proj.weight", k
        yield p + "self_attn.v_proj.weight", v
        if arch.qkv_bias:
            qb, kb, vb = qkv_split(own[m + "self_attention.linear_qkv.bias"], arch)
            yield p + "self_attn.q_proj.bias", qb
            yield p + "self_attn.k_proj.bias", kb
            yield p + "self_attn.v_proj.bias", vb
        yield p + "self_attn.o_proj.weight", own[m + "self_attention.linear_proj.weight"]
        yield p + "post_attention_layernorm.weight", own[m + "pre_mlp_layernorm.weight"]
        gate, up = own[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        yield p + "mlp.gate_proj.weight", gate
        yield p + "mlp.up_proj.weight", up
        yield p + "mlp.down_proj.weight", own[m + "mlp.linear_fc2.weight"]
    yield "model.norm.weight", own["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", own["output_layer.weight"]


def _new_file_mode(d: Path) -> int:
    """The mode a file created here gets (0644 under the usual umask), read without touching the umask."""
    probe = d / ".mode-probe"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


def write_hf_weights(directory: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` into ``directory`` as HF safetensors (sharded with an index past
    ``max_shard_bytes``); returns the file names written."""
    d = Path(directory)
    mode = _new_file_mode(d)
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size, total = 0, 0

    def flush():
        nonlocal current, size
        if current:
            shard = d / f".shard-{len(shards):05d}"
            save_file(current, str(shard), metadata={"format": "pt"})
            os.chmod(shard, mode)  # safetensors creates it 0600; the other files get the umask's mode
            shards.append(list(current))
            current, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
        total += nbytes
    flush()
    if len(shards) == 1:
        (d / ".shard-00000").rename(d / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for i, (keys, fname) in enumerate(zip(shards, names, strict=True)):
        (d / f".shard-{i:05d}").rename(d / fname)
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


__all__ = ["DEFAULT_SHARD_BYTES", "hf_state_from_model", "write_hf_weights"]
