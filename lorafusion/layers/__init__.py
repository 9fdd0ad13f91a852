"""Megatron-core integration: multi-adapter LoRA linears, target mapping, injection and routing."""

from lorafusion.layers.adapter import LoRASpec, check_adapter_name
from lorafusion.layers.inject import (
    adapter_parameters,
    add_adapter,
    attach_lora_context,
    get_lora_context,
    lora_batch,
    lora_modules,
    remove_adapter,
    set_batch,
)
from lorafusion.layers.lora_linear import LoRAColumnParallelLinear, LoRAContext, LoRARowParallelLinear
from lorafusion.layers.targets import MEGATRON_TARGETS, resolve_target_modules, to_peft_target_modules
from lorafusion.core.routing import Routing

__all__ = ["LoRASpec", "check_adapter_name", "adapter_parameters", "add_adapter", "attach_lora_context",
           "get_lora_context", "lora_batch", "lora_modules", "remove_adapter", "set_batch",
           "LoRAColumnParallelLinear", "LoRARowParallelLinear", "LoRAContext", "MEGATRON_TARGETS",
           "resolve_target_modules", "to_peft_target_modules", "Routing"]
