"""HF LLaMA / Qwen2 checkpoint directory → lorafusion model (this rank's TP shard and PP stage).

Reads ``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every
error names the file (and tensor) and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lorafusion.core.errors import ConfigError, MissingFileError, MissingTensorError
from lorafusion.core.arch import ModelArch, arch_from_hf_config
from lorafusion.layers.fp8_base import base_tensor_like, write_base_tensor
from lorafusion.layers.sharding import param_split, tp_rank
from lorafusion.models.hf_layout import qkv_merge
from lorafusion.models.provider import build_model


class HFCheckpoint:
    """Lazy tensor access to a HF safetensors checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError(
                f"model.path: {self.path} is not a directory (expected a HF model directory)")
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise MissingFileError(f"{cfg_file}: missing (expected the HF config.json)")
        try:
            self.config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from e
        self.arch: ModelArch = arch_from_hf_config(self.config, str(cfg_file))
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ConfigError(f"{index}: expected JSON with a 'weight_map' object ({e})") from e
            self.files = {k: self.path / v for k, v in weight_map.items()}
        elif single.is_file():
            try:
                open(single, "rb").close()  # (safetensors reports an unreadable file as "No such file")
            except OSError as e:
                raise MissingFileError(f"{single}: cannot read ({e.strerror or e})") from None
            try:
                with safe_open(str(single), framework="pt") as f:
                    keys = list(f.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ConfigError(f"{single}: not a readable safetensors file ({e})") from e
            self.files = {k: single for k in keys}
        else:
            raise MissingFileError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._handles: dict[Path, object] = {}

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if key not in self.files:
            raise MissingTensorError(f"{self.path}: tensor {key!r} not found in the checkpoint")
        file = self.files[key]
        if file not in self._handles:
            if not file.is_file():
                raise MissingFileError(f"{file}: missing (listed in model.safetensors.index.json)")
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as e:
                raise ConfigError(f"{file}: not a readable safetensors file ({e})") from e
        try:
            t = self._handles[file].get_tensor(key)
        except Exception as e:
            raise ConfigError(f"{file}: cannot read tensor {key!r} ({e})") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ConfigError(f"{file}: tensor {key!r} has shape {tuple(t.shape)}, but config.json implies "
                              f"{tuple(shape)}")
        # every job would "diverge" from step 1
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{file}: tensor {key!r} holds non-finite values (NaN or inf); the base model "
                              f"is damaged")
        return t


def hf_state_for_rank(ckpt: HFCheckpoint, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The Megatron state-dict entries of ``model`` (this TP rank / PP stage) from the HF checkpoint; each
    tensor cut to this rank by the split its module names (:func:`lorafusion.layers.sharding.param_split`)."""
    a = ckpt.arch
    tp, rank = tp_rank()
    h, hn, f = a.hidden_size, a.kv_channels, a.ffn_hidden_size
    nq, ng = a.num_attention_heads, a.num_query_groups
    out: dict[str, torch.Tensor] = {}

    def put(key: str, module: torch.nn.Module, attr: str, full: torch.Tensor) -> None:
        out[key] = param_split(module, attr).shard(full, tp, rank)

    if getattr(model, "pre_process", True):
        put("embedding.word_embeddings.weight", model.embedding.word_embeddings, "weight",
            ckpt.get("model.embed_tokens.weight", (a.vocab_size, h)))
    for local, layer in enumerate(model.decoder.layers):
        i = layer.layer_number - 1
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        attn, mlp = layer.self_attention, layer.mlp
        out[m + "input_layernorm.weight"] = ckpt.get(p + "input_layernorm.weight", (h,))
        out[m + "pre_mlp_layernorm.weight"] = ckpt.get(p + "post_attention_layernorm.weight", (h,))
        q = ckpt.get(p + "self_attn.q_proj.weight", (nq * hn, h))
        k = ckpt.get(p + "self_attn.k_proj.weight", (ng * hn, h))
        v = ckpt.get(p + "self_attn.v_proj.weight", (ng * hn, h))
        put(m + "self_attention.linear_qkv.weight", attn.linear_qkv, "weight", qkv_merge(q, k, v, a))
        if a.qkv_bias:
            qb = ckpt.get(p + "self_attn.q_proj.bias", (nq * hn,))
            kb = ckpt.get(p + "self_attn.k_proj.bias", (ng * hn,))
            vb = ckpt.get(p + "self_attn.v_proj.bias", (ng * hn,))
            put(m + "self_attention.linear_qkv.bias", attn.linear_qkv, "bias", qkv_merge(qb, kb, vb, a))
        put(m + "self_attention.linear_proj.weight", attn.linear_proj, "weight",
            ckpt.get(p + "self_attn.o_proj.weight", (h, nq * hn)))
        gate = ckpt.get(p + "mlp.gate_proj.weight", (f, h))
        up = ckpt.get(p + "mlp.up_proj.weight", (f, h))
        put(m + "mlp.linear_fc1.weight", mlp.linear_fc1, "weight", torch.cat([gate, up], 0))
        put(m + "mlp.linear_fc2.weight", mlp.linear_fc2, "weight",
            ckpt.get(p + "mlp.down_proj.weight", (h, f)))
    if getattr(model, "post_process", True):
        out["decoder.final_layernorm.weight"] = ckpt.get("model.norm.weight", (h,))
        if a.tie_word_embeddings:
            if not getattr(model, "pre_process", True):  # last stage keeps its own copy of the tied weight
                put("output_layer.weight", model.output_layer, "weight",
                    ckpt.get("model.embed_tokens.weight", (a.vocab_size, h)))
        else:
            put("output_layer.weight", model.output_layer, "weight",
                ckpt.get("lm_head.weight", (a.vocab_size, h)))
    return out


def load_hf_weights(model: torch.nn.Module, path: str | Path | HFCheckpoint) -> ModelArch:
    """Copy HF weights into ``model`` (built for the same architecture); returns the checkpoint's arch."""
    ckpt = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    arch = getattr(getattr(model, "config", None), "arch", None)
    if arch is not None and arch != ckpt.arch:
        raise ConfigError(
            f"{ckpt.path / 'config.json'}: architecture {ckpt.arch} does not match the model's {arch}")
    state = hf_state_for_rank(ckpt, model)
    with torch.no_grad():
        for key, value in state.items():
            owner, _, attr = key.rpartition(".")
            try:
                mod = model.get_submodule(owner)
                own = base_tensor_like(mod, attr)  # (an FP8 linear's weight: its FP8 buffer's shape)
            except AttributeError:
                own = None
            if own is None:
                raise KeyError(f"internal: model has no parameter {key!r}")
            if own.shape != value.shape:
                raise ConfigError(f"{ckpt.path}: {key} would get shape {tuple(value.shape)}, model expects "
                                  f"{tuple(own.shape)}")
            write_base_tensor(mod, attr, value)  # (cast to the model dtype; an FP8 linear quantizes it)
    return ckpt.arch


def build_model_from_hf(path: str | Path | HFCheckpoint, *, params_dtype: torch.dtype = torch.float32, **kw):
    """Build this rank's stage of the HF model at ``path`` and load its weights (``base_precision="fp8"``: the
    FP8 linears quantize them as they are written, see :mod:`lorafusion.layers.fp8_base`)."""
    ckpt = path if isinstance(path, HFCheckpoint) else HFCheckpoint(path)
    # base_model: what exported adapters name as their base
    model = build_model(ckpt.arch, params_dtype=params_dtype, base_model=str(ckpt.path.resolve()), **kw)
    # virtual pipeline: each chunk
    for chunk in (model if isinstance(model, torch.nn.ModuleList) else [model]):
        load_hf_weights(chunk, ckpt)
    return model
