"""Model architecture description (LLaMA / Qwen2 families): ``ModelArch``, presets and the HF
``config.json`` mapping. ``ModelArch`` is the one place an architecture is described; presets, HF import,
export and the provider (``lorafusion.models``) all go through it. torch is imported only by ``inv_freq``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from lorafusion.core.errors import ConfigError

__all__ = ["PRESETS", "ModelArch", "RopeScaling", "arch_from_hf_config", "arch_to_hf_config", "preset"]


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3 style RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    family: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"model.family: expected 'llama' or 'qwen2', got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}: expected a positive integer, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_query_groups: {self.num_query_groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size: {self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}; give head_dim explicitly")

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def inv_freq(self):
        """RoPE inverse frequencies exactly as HF computes them (including llama3 scaling); a torch tensor."""
        import torch

        dim = self.kv_channels
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        rs = self.rope_scaling
        if rs is None:
            return inv
        low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(is_medium, smoothed, scaled)


def _arch(**kw) -> ModelArch:
    return ModelArch(**kw)


PRESETS: dict[str, ModelArch] = {
    # tiny models for tests and the demo
    "tiny-llama": _arch(family="llama", vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=8,
                        num_query_groups=2, ffn_hidden_size=160, max_position_embeddings=1024,
                        rope_theta=10000.0),
    "tiny-qwen2": _arch(family="qwen2", vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=8,
                        num_query_groups=2, ffn_hidden_size=160, max_position_embeddings=1024,
                        rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=True),
    # full-size shapes (random weights unless imported from HF)
    "llama3.1-8b": _arch(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                         num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                         max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=RopeScaling()),
    "llama3.1-70b": _arch(family="llama", vocab_size=128256, hidden_size=8192, num_layers=80,
                          num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672,
                          max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=RopeScaling()),
    "qwen2.5-32b": _arch(family="qwen2", vocab_size=152064, hidden_size=5120, num_layers=64,
                         num_attention_heads=40, num_query_groups=8, ffn_hidden_size=27648,
                         max_position_embeddings=32768, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
    "qwen2.5-7b": _arch(family="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28,
                        num_attention_heads=28, num_query_groups=4, ffn_hidden_size=18944,
                        max_position_embeddings=32768, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
}


def preset(name: str, **overrides) -> ModelArch:
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def _mapping(cfg, source: str) -> dict:
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object (a HF model config), got {type(cfg).__name__}")
    return cfg


def _check_numbers(cfg: dict, source: str) -> None:
    """The numeric fields' types (e.g. "hidden_size": "64" would otherwise fail deep inside the model
    build)."""
    _ints = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings", "head_dim")
    for key in _ints:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"{source}: {key}: expected a positive integer, got {v!r}")
    for key in ("rope_theta", "rms_norm_eps"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)):
            raise ConfigError(f"{source}: {key}: expected a finite number, got {v!r}")


def _rope_scaling(cfg: dict, source: str) -> RopeScaling | None:
    """llama3 RoPE scaling from ``rope_scaling`` (or transformers 5's ``rope_parameters``); None without."""
    rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters")
                                     if isinstance(cfg.get("rope_parameters"), dict)
                                     and cfg["rope_parameters"].get("rope_type", "default") != "default"
                                     else None)
    if not rs:
        return None
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype != "llama3":
        raise ConfigError(
            f"{source}: rope_scaling.rope_type: expected 'llama3' (or no scaling), got {rtype!r}")
    return RopeScaling(factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                       high_freq_factor=float(rs["high_freq_factor"]),
                       original_max_position_embeddings=int(rs["original_max_position_embeddings"]))


def arch_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArch:
    """Map a HF LlamaConfig / Qwen2Config dict to ``ModelArch`` (errors name the file and field)."""
    mt = _mapping(cfg, source).get("model_type")
    if mt not in ("llama", "qwen2"):
        raise ConfigError(f"{source}: model_type: expected 'llama' or 'qwen2', got {mt!r}")
    _check_numbers(cfg, source)

    def need(key):
        if key not in cfg:
            raise ConfigError(f"{source}: missing field {key!r}")
        return cfg[key]

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act: expected 'silu', got {act!r}")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias: expected false (MLP biases are not supported)")
    if mt == "llama" and cfg.get("attention_bias"):
        raise ConfigError(
            f"{source}: attention_bias: expected false for llama (o_proj bias is not supported)")
    scaling = _rope_scaling(cfg, source)
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), dict):
        theta = cfg["rope_parameters"].get("rope_theta")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim == hidden // heads:
        head_dim = None
    qkv_bias = mt == "qwen2"
    try:
        return ModelArch(
            family=mt, vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_attention_heads=heads, num_query_groups=cfg.get("num_key_value_heads") or heads,
            ffn_hidden_size=need("intermediate_size"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, head_dim=head_dim,
        )
    except ValueError as e:  # an inconsistent config.json
        raise ConfigError(f"{source}: {e}") from None


def arch_to_hf_config(arch: ModelArch) -> dict:
    """The HF config.json dict for ``arch`` (used by tests and export)."""
    cfg = {
        "model_type": arch.family,
        "architectures": ["LlamaForCausalLM" if arch.family == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_query_groups,
        "intermediate_size": arch.ffn_hidden_size, "max_position_embeddings": arch.max_position_embeddings,
        "rope_theta": arch.rope_theta, "rms_norm_eps": arch.norm_eps,
        "tie_word_embeddings": arch.tie_word_embeddings, "hidden_act": "silu", "head_dim": arch.kv_channels,
    }
    if arch.family == "llama":
        cfg["attention_bias"] = arch.qkv_bias
        cfg["mlp_bias"] = False
    if arch.rope_scaling is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", **asdict(arch.rope_scaling)}
    return cfg
