"""Megatron-core integration: multi-adapter LoRA linears, injection and per-microbatch routing.
(The LoRA schema and target names are core vocabulary: :mod:`lorafusion.core.lora`,
:mod:`lorafusion.core.targets`.)"""

from lorafusion.layers.inject import (
    adapter_parameters,
    add_adapter,
    get_lora_context,
    lora_batch,
    lora_modules,
    remove_adapter,
    set_batch,
)
from lorafusion.layers.lora_linear import LoRAColumnParallelLinear, LoRAContext, LoRARowParallelLinear
from lorafusion.core.routing import Routing

__all__ = ["adapter_parameters", "add_adapter", "get_lora_context", "lora_batch",
           "lora_modules", "remove_adapter", "set_batch", "LoRAColumnParallelLinear", "LoRARowParallelLinear",
           "LoRAContext", "Routing"]
