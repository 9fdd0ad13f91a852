"""Adding, removing and routing adapters on a live model (or list of pipeline model chunks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from lorafusion.core.lora import LoRASpec, check_adapter_name
from lorafusion.core.routing import Routing
from lorafusion.core.targets import MEGATRON_TARGETS
from lorafusion.layers.lora_linear import LoRAContext, _LoRAMixin


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, Sequence | torch.nn.ModuleList) else [model]


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module") and not isinstance(m, _LoRAMixin):
        m = m.module
    return m


def lora_modules(model) -> Iterator[tuple[str, _LoRAMixin]]:
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
                if isinstance(mod, _LoRAMixin):
                    yield f"{layer.layer_number}.{kind}", mod


def get_lora_context(model) -> LoRAContext:
    ctx = getattr(_unwrap(_chunks(model)[0]), "lora_context", None)
    if ctx is None:
        raise ValueError("model has no LoRA context: build it with lorafusion.models.build_model")
    return ctx


def attach_lora_context(model, ctx: LoRAContext | None = None) -> LoRAContext:
    """Give every LoRA linear of ``model`` the same context object (idempotent)."""
    ctx = ctx or LoRAContext()
    for chunk in _chunks(model):
        _unwrap(chunk).lora_context = ctx
    for key, mod in lora_modules(model):
        mod.lora_ctx = ctx
        mod.lora_key = key
        ctx.register_layer(key)
        mod.lora_kind = key.split(".", 1)[1]
    return ctx


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


def set_batch(model, routing: Routing | None, adapters: Sequence[str], seeds: Sequence[int] | None = None) -> None:
    """Non-context-manager form of :func:`lora_batch` (the runtime sets it per microbatch)."""
    get_lora_context(model).set_batch(routing, adapters, seeds)
