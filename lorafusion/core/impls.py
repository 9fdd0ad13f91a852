"""Which implementation runs an op — one choice, one vocabulary.

``"triton"``: our Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``); ``"torch"``: plain torch on
any device; None: automatic (Triton on CUDA, torch elsewhere). Every op takes its ``impl`` in these words:
the LoRA ops (:mod:`lorafusion.ops`, ``LoRAContext.impl``) and the model ops around the LoRA layers
(:mod:`lorafusion.models.fused`, whose ``fused_ops`` adds ``"off"``: Megatron's own modules, none of ours).

The run YAML keeps its own spelling of the LoRA ops' choice, ``kernels: auto | fused | reference``;
:func:`lora_impl` reads it (the one place that knows it). The LoRA ops also take "fused" / "reference" for
"triton" / "torch" (:func:`spelled`), so code written in the YAML's words reaches the same op.
"""

from __future__ import annotations

IMPLS = ("torch", "triton")
KERNELS = {"auto": None, "fused": "triton", "reference": "torch"}  # the run YAML's `kernels` -> impl
_SPELLINGS = {"fused": "triton", "reference": "torch"}


def lora_impl(kernels: str) -> str | None:
    """The LoRA ops' implementation for the run YAML's ``kernels`` value (None: automatic)."""
    return KERNELS[kernels]


def kernels_name(impl: str) -> str:
    """The run YAML's word for an implementation ("fused" / "reference"): what summary.json records."""
    return {v: k for k, v in _SPELLINGS.items()}[impl]


def spelled(impl: str) -> str:
    """``impl`` with the YAML's words "fused" / "reference" read as "triton" / "torch" (anything else as
    is)."""
    return _SPELLINGS.get(impl, impl)


def check_impl(impl: str, what: str = "impl") -> str:
    """``impl`` if it is one of :data:`IMPLS`; ValueError naming ``what`` otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"{what}: expected one of {IMPLS}, got {impl!r}")
    return impl


__all__ = ["IMPLS", "KERNELS", "check_impl", "kernels_name", "lora_impl", "spelled"]
