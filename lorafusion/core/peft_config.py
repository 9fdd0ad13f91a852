"""A PEFT adapter's ``adapter_config.json`` → :class:`LoRASpec` (torch-free: the config loader checks a job's
``init_from`` with it before anything heavy is imported; the import reads the tensors itself)."""

from __future__ import annotations

import json
from pathlib import Path

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.core.lora import LoRASpec

__all__ = ["COMPARED", "read_peft_config", "spec_from_peft_config"]

# the LoRA settings a job that starts from an adapter must share with it (lora_dropout and shared_fused_a are
# the job's own: dropout only acts in training, and PEFT's files cannot record a shared A)
COMPARED = ("r", "lora_alpha", "use_rslora", "target_modules")


def read_peft_config(path: str | Path) -> tuple[dict, LoRASpec]:
    """(the raw config, its spec) of the PEFT adapter directory ``path``; one error naming the file
    otherwise."""
    cfg_file = Path(path) / "adapter_config.json"
    if not cfg_file.is_file():
        raise MissingFileError(f"{cfg_file}: missing (expected a PEFT adapter directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, spec_from_peft_config(cfg, str(cfg_file))


def spec_from_peft_config(cfg: dict, where: str) -> LoRASpec:
    """The LoRA settings of a PEFT LoRA config, if this project can load it exactly (else ConfigError)."""
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type: expected 'LORA', got {cfg.get('peft_type')!r}")
    for field, ok in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False), ("lora_bias", False)):
        if cfg.get(field, ok) != ok:
            raise ConfigError(f"{where}: {field}: expected {ok!r}, got {cfg.get(field)!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise ConfigError(
                f"{where}: {field}: per-module ranks/alphas cannot be imported (expected empty)")
    for field in ("modules_to_save", "layers_to_transform", "layers_pattern", "layer_replication",
                  "trainable_token_indices", "exclude_modules", "target_parameters"):
        if cfg.get(field):
            raise ConfigError(f"{where}: {field}: expected null, got {cfg.get(field)!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(
            f"{where}: target_modules: a regex string cannot be mapped exactly; expected a list")
    if isinstance(targets, list | tuple):  # PEFT matches a name or a module path ending in it (it writes
        # all-linear out as paths: model.layers.0.self_attn.q_proj); layers missing from a list of paths
        # are reported by the import (a targeted layer's tensors missing)
        targets = sorted({t.rsplit(".", 1)[-1] if isinstance(t, str) else t for t in targets})
    try:
        return LoRASpec(r=cfg.get("r"), lora_alpha=cfg.get("lora_alpha"),
                        lora_dropout=cfg.get("lora_dropout", 0.0), target_modules=targets,
                        use_rslora=bool(cfg.get("use_rslora", False)))
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
