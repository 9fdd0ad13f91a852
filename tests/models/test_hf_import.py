"""HF LLaMA/Qwen2 checkpoints → our Megatron model: logits equal transformers'; bad input is one clear
error."""

import json

import pytest
import torch

from hf_utils import write_hf_checkpoint
from lorafusion.models.hf_import import HFCheckpoint, build_model_from_hf, load_hf_weights
from lorafusion.models.provider import build_model
from lorafusion.core.arch import ModelArch, RopeScaling, arch_from_hf_config, preset

ARCHS = {
    "llama-gqa-8x2": ModelArch(family="llama", vocab_size=300, hidden_size=64, num_layers=2,
                               num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                               max_position_embeddings=256),
    "llama-untied-odd": ModelArch(family="llama", vocab_size=101, hidden_size=90, num_layers=3,
                                  num_attention_heads=5, num_query_groups=5, ffn_hidden_size=130,
                                  max_position_embeddings=128, rope_theta=500000.0,
                                  rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0,
                                                           high_freq_factor=2.0,
                                                           original_max_position_embeddings=64)),
    "llama-tied": ModelArch(family="llama", vocab_size=200, hidden_size=32, num_layers=2,
                            num_attention_heads=4, num_query_groups=1, ffn_hidden_size=64,
                            tie_word_embeddings=True),
    "qwen2-gqa": ModelArch(family="qwen2", vocab_size=150, hidden_size=56, num_layers=2,
                           num_attention_heads=4, num_query_groups=2, ffn_hidden_size=120, qkv_bias=True,
                           rope_theta=1e6, norm_eps=1e-6),
}


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("shards", [1, 3])
def test_logits_equal_transformers(name, shards, tmp_path, megatron_single):
    arch = ARCHS[name]
    hf = write_hf_checkpoint(arch, tmp_path / "m", seed=shards, shards=shards)
    assert arch_from_hf_config(json.loads((tmp_path / "m" / "config.json").read_text())) == arch
    model = build_model_from_hf(tmp_path / "m")
    ids = torch.randint(0, arch.vocab_size, (2, 40))
    ours = model(ids, torch.arange(40)[None].expand(2, -1), attention_mask=None)
    ref = hf(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-4


def _write(tmp_path, arch=None):
    arch = arch or preset("tiny-llama", num_layers=1)
    write_hf_checkpoint(arch, tmp_path / "m")
    return tmp_path / "m"


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        HFCheckpoint(tmp_path / "nope")


def test_missing_config(tmp_path):
    d = _write(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json: missing"):
        HFCheckpoint(d)


def test_corrupt_config(tmp_path):
    d = _write(tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        HFCheckpoint(d)


def test_unsupported_model_type(tmp_path):
    d = _write(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: model_type: expected 'llama' or 'qwen2'"):
        HFCheckpoint(d)


def test_missing_weights_file(tmp_path):
    d = _write(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        HFCheckpoint(d)


def test_corrupt_safetensors(tmp_path):
    d = _write(tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        HFCheckpoint(d)


def test_missing_tensor(tmp_path, megatron_single):
    from safetensors.torch import load_file, save_file

    d = _write(tmp_path)
    state = load_file(d / "model.safetensors")
    state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.layers.0.mlp.up_proj.weight"):
        build_model_from_hf(d)


def test_shape_mismatch_between_config_and_weights(tmp_path, megatron_single):
    d = _write(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 200
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj.weight' has shape \(160, 64\), but config.json implies "
                                         r"\(200, 64\)"):
        build_model_from_hf(d)


def test_architecture_mismatch_with_model(tmp_path, megatron_single):
    d = _write(tmp_path)
    model = build_model(preset("tiny-llama", num_layers=2))
    with pytest.raises(ValueError, match="does not match the model"):
        load_hf_weights(model, d)


def test_sharded_index_pointing_to_missing_file(tmp_path, megatron_single):
    arch = preset("tiny-llama", num_layers=1)
    write_hf_checkpoint(arch, tmp_path / "m", shards=3)
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        build_model_from_hf(tmp_path / "m")


@pytest.mark.parametrize("key, value",
                         [("hidden_size", "64"), ("num_hidden_layers", 2.5), ("vocab_size", True),
                          ("intermediate_size", -3), ("rms_norm_eps", "1e-6")])
def test_bad_number_in_config_json_is_one_error_naming_the_field(key, value):
    from lorafusion.core.arch import arch_to_hf_config
    from lorafusion.core.errors import ConfigError

    cfg = arch_to_hf_config(preset("tiny-llama"))
    cfg[key] = value
    with pytest.raises(ConfigError,
                       match=rf"^m/config.json: {key}: expected a (positive integer|finite number)"):
        arch_from_hf_config(cfg, source="m/config.json")
