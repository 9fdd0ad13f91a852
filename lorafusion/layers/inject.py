"""Adding, removing and routing adapters on a live model (or list of pipeline model chunks).

The model's LoRA linears and its :class:`~lorafusion.layers.lora_linear.LoRAContext` are wired when it is
built (:mod:`lorafusion.models.layer_spec`); this module finds them (:func:`lora_modules`,
:func:`get_lora_context`) and changes only what changes at run time: which adapters are on the model and
which rows each microbatch routes to them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from lorafusion.core.lora import LoRASpec, check_adapter_name
from lorafusion.core.routing import Routing
from lorafusion.core.targets import MEGATRON_TARGETS
from lorafusion.layers.fp8_base import base_tensor_like
from lorafusion.layers.lora_linear import LoRAContext, LoRALinear


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, Sequence | torch.nn.ModuleList) else [model]


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module") and not isinstance(m, LoRALinear):
        m = m.module
    return m


def lora_modules(model) -> Iterator[tuple[str, LoRALinear]]:
    """(key, module) for every LoRA-capable linear; key = "<global 1-based layer number>.<megatron name>"."""
    for chunk in _chunks(model):
        chunk = _unwrap(chunk)
        decoder = getattr(chunk, "decoder", None)
        if decoder is None:
            continue
        for layer in decoder.layers:
            for kind in MEGATRON_TARGETS:
                parent = layer.self_attention if kind in ("linear_qkv", "linear_proj") else layer.mlp
                mod = getattr(parent, kind, None)
                if isinstance(mod, LoRALinear):
                    yield mod.lora_key, mod


def get_lora_context(model) -> LoRAContext:
    """The context the model was built with (``lorafusion.models.provider.build_model``; one for all
    chunks)."""
    ctx = getattr(_unwrap(_chunks(model)[0]), "lora_context", None)
    if ctx is None:
        raise ValueError("model has no LoRA context: build it with lorafusion.models.build_model")
    return ctx


def base_weight_bytes(model) -> int:
    """Bytes of the decoder linears' base weights on this rank (FP8: the fp8 weights and their scales)."""
    total = 0
    for _, mod in lora_modules(model):
        for t in (base_tensor_like(mod, "weight"), getattr(mod, "weight_scale", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def add_adapter(model, name: str, spec: LoRASpec, seed: int = 0) -> None:
    """Add adapter ``name`` to every targeted linear. Init like PEFT (A kaiming-uniform, B zero) from
    (seed, name, layer): independent of which other adapters share the model."""
    check_adapter_name(name)
    ctx = get_lora_context(model)
    if name in ctx.specs:
        raise ValueError(f"adapter name clash: {name!r} is already on the model")
    for key, mod in lora_modules(model):
        if mod.lora_kind in spec.megatron_targets:
            mod.add_lora(name, spec, seed)
    ctx.specs[name] = spec
    ctx._local.clear()


def remove_adapter(model, name: str) -> None:
    ctx = get_lora_context(model)
    if name not in ctx.specs:
        raise KeyError(f"adapter {name!r} is not on the model (adapters: {sorted(ctx.specs)})")
    if name in ctx.batch_adapters:
        ctx.set_batch(None, ())
    for _, mod in lora_modules(model):
        if name in mod.lora_A:
            mod.remove_lora(name)
    del ctx.specs[name]


def adapter_parameters(model, name: str) -> dict[str, torch.nn.Parameter]:
    """{"<layer>.<kind>.lora_A": param, ...} for one adapter on this rank."""
    out = {}
    for key, mod in lora_modules(model):
        if name in mod.lora_A:
            out[f"{key}.lora_A"] = mod.lora_A[name]
            out[f"{key}.lora_B"] = mod.lora_B[name]
    return out


@contextlib.contextmanager
def lora_batch(model, routing: Routing | None, adapters: Sequence[str], seeds: Sequence[int] | None = None):
    """Route the rows of the next forward(s): segment slot i → ``adapters[i]``."""
    ctx = get_lora_context(model)
    prev = ctx.state()
    ctx.set_batch(routing, adapters, seeds)
    try:
        yield ctx
    finally:
        ctx.set_batch(*prev)


def set_batch(model, routing: Routing | None, adapters: Sequence[str],
              seeds: Sequence[int] | None = None) -> None:
    """Non-context-manager form of :func:`lora_batch` (the runtime sets it per microbatch)."""
    get_lora_context(model).set_batch(routing, adapters, seeds)
