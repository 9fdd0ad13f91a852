"""Model providers (LLaMA / Qwen2 presets), HF import, packed attention."""

from lorafusion.core.arch import PRESETS, ModelArch, RopeScaling, arch_from_hf_config, preset

__all__ = ["PRESETS", "ModelArch", "RopeScaling", "arch_from_hf_config", "preset"]
