"""One LoRA adapter's hyper-parameters (PEFT names): the only LoRA schema.

:class:`LoRASpec` is a frozen pydantic model. The run config validates job YAMLs through it (so a bad
``lora`` section is reported with file and field like every other), and code builds it directly
(``LoRASpec(r=8, lora_alpha=16)``; a bad value raises one ``ValueError`` naming ``lora.<field>``).
``target_modules`` is normalised (see :func:`lorafusion.core.targets.resolve_target_modules`): Megatron names
for linears targeted whole, PEFT names for a subset of a fused linear's projections (``q_proj``, ``v_proj``).

On the fused linears (``linear_qkv`` = q/k/v, ``linear_fc1`` = gate/up) each targeted projection has its own A
and B, as in PEFT (the default); ``shared_fused_a: true`` gives the fused linear one A shared by its
projections (LoRAFusion's merged-QKV LoRA: fewer parameters, a different model than PEFT's at the same r).
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorafusion.core.targets import (
    COLUMN_PARALLEL,
    megatron_targets,
    partial_groups,
    projections,
    resolve_target_modules,
)

__all__ = ["ADAPTER_NAME_MAX", "ADAPTER_NAME_RE", "LoRASpec", "check_adapter_memory", "check_adapter_name",
           "lora_layer_params", "lora_memory_bytes", "lora_s_width", "projection_shapes"]

ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9_\-]+")  # used with fullmatch (``$`` would let "name\n" through)
# the longest file name a run derives from a job name is a request's temporary file,
# ``.<20-digit stamp>-submit-<name>.json.tmp`` (38 characters more): 128 keeps every one far below
# NAME_MAX (255)
ADAPTER_NAME_MAX = 128
MAX_RANK, MAX_ALPHA = 1 << 16, 1e6  # lora.r above any real hidden size; lora_alpha


def check_adapter_name(name: Any, field: str | None = "adapter name") -> str:
    """``name`` if it is a valid adapter/job name (1 to :data:`ADAPTER_NAME_MAX` letters, digits, '_' or '-'),
    else a ValueError whose message starts with ``field`` (None: pydantic names the field)."""
    prefix = "" if field is None else f"{field}: "
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name):
        raise ValueError(prefix + f"expected letters, digits, '_' or '-', got {name!r}"[:200])
    if len(name) > ADAPTER_NAME_MAX:
        raise ValueError(prefix + f"expected at most {ADAPTER_NAME_MAX} characters (file names are derived "
                         f"from it), got {len(name)}: {name[:40]!r}...")
    return name


class LoRASpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=False,
                              allow_inf_nan=False)

    r: int = Field(gt=0, le=MAX_RANK)  # (the other bounds: lorafusion/config/bounds.py)
    lora_alpha: float = Field(gt=0, le=MAX_ALPHA)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # all-linear
    use_rslora: bool = False
    # one A shared by the projections of a fused linear (q/k/v, gate/up) instead of PEFT's one A each
    shared_fused_a: bool = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:  # direct construction: one ValueError naming lora.<field>
            lines = []
            for err in e.errors(include_url=False):
                loc = ".".join(str(p) for p in err["loc"])
                msg = str((err.get("ctx") or {}).get("error", err["msg"]))
                lines.append((f"lora.{loc}: {msg}" if loc else f"lora.{msg}")
                             + ("" if err["type"] == "value_error" else f", got {err.get('input')!r}"))
            raise ValueError("\n".join(lines)) from None

    # Nested in a run config, pydantic validates the section itself (its errors then name file and field
    # like every other); marking this __init__ as pydantic's own keeps it out of that path.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v: Any) -> tuple[str, ...]:
        if not isinstance(v, str | list | tuple) or (
                not isinstance(v, str) and not all(isinstance(x, str) for x in v)):
            raise ValueError(f"expected a module name or a list of module names, got {v!r}")
        try:
            return resolve_target_modules(v)
        except ValueError as e:  # pydantic puts the field in front itself
            raise ValueError(str(e).removeprefix("lora.target_modules: ")) from None

    @model_validator(mode="after")
    def _shared_needs_whole_groups(self):
        part = partial_groups(self.target_modules)
        if self.shared_fused_a and part:
            kind, got = next(iter(part.items()))
            raise ValueError(f"target_modules: {', '.join(got)} is part of the fused {kind}; one shared A "
                             "(shared_fused_a: true) has no exact LoRA for a subset: target the whole group "
                             f"or set shared_fused_a: false")
        return self

    @property
    def megatron_targets(self) -> tuple[str, ...]:
        """The Megatron linears this adapter touches, in layer order."""
        return megatron_targets(self.target_modules)

    def projections(self, kind: str) -> tuple[str, ...]:
        """The PEFT projections of Megatron linear ``kind`` this adapter targets (() when none)."""
        return projections(self.target_modules, kind)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def projection_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT projection of a decoder layer of ``arch`` (unsharded)."""
    h, kv, ffn = arch.hidden_size, arch.kv_channels, arch.ffn_hidden_size
    q, k = arch.num_attention_heads * kv, arch.num_query_groups * kv
    return {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h), "gate_proj": (h, ffn),
            "up_proj": (h, ffn), "down_proj": (ffn, h)}


def lora_layer_params(arch: Any, r: int, target_modules: tuple[str, ...], *, shared_a: bool = False,
                      tp: int = 1) -> int | float:
    """One adapter's LoRA parameters in one decoder layer on one TP rank — the one count of an adapter's size
    (the memory model, the run's admission and ``submit``'s check all use it). Per targeted projection
    (normalised ``target_modules``: Megatron names for whole linears, PEFT names for a subset) a B (out x r)
    and an A (r x in); with ``shared_a`` one A for the projections of a fused linear. Column-parallel linears
    (qkv, fc1) shard B over ``tp``, row-parallel ones (proj, fc2) shard A."""
    shapes, n = projection_shapes(arch), 0
    for kind in megatron_targets(target_modules):
        projs = projections(target_modules, kind)
        a = r * shapes[projs[0]][0] * (1 if shared_a else len(projs))
        b = r * sum(shapes[p][1] for p in projs)
        n += a + b / tp if kind in COLUMN_PARALLEL else a / tp + b
    return n if tp > 1 else int(n)


def lora_s_width(r: int, target_modules: tuple[str, ...], *, shared_a: bool = False) -> int:
    """Values of S = dropout(X)·Aᵀ an adapter saves per token in one decoder layer: ``r`` per A."""
    return sum(r * (1 if shared_a else len(projections(target_modules, kind)))
               for kind in megatron_targets(target_modules))


def lora_memory_bytes(spec: LoRASpec, arch: Any, token_capacity: int, *, layers: int | None = None,
                      tp: int = 1, bytes_per_param: int = 16) -> int:
    """Bytes an adapter of ``spec`` on ``arch`` (a :class:`lorafusion.core.arch.ModelArch`) needs to train on
    ``layers`` decoder layers (default all: over all ranks) sharded over ``tp``, from the shapes alone
    (nothing is allocated; exact integers, whatever ``r``): fp32 weights, gradients and two AdamW moments (16
    bytes a parameter; 12 once the weights exist) and its LoRA activations (S: :func:`lora_s_width` fp32
    values per token and layer) at ``token_capacity``."""
    layers = arch.num_layers if layers is None else layers
    params = lora_layer_params(arch, spec.r, spec.target_modules, shared_a=spec.shared_fused_a, tp=tp)
    width = lora_s_width(spec.r, spec.target_modules, shared_a=spec.shared_fused_a)
    return int(bytes_per_param * params * layers) + 4 * width * layers * int(token_capacity)


def check_adapter_memory(job: str, spec: LoRASpec, arch: Any, token_capacity: int, memory_bytes: int,
                         model_parallel: int) -> None:
    """ConfigError when job's adapter could never fit one rank: its :func:`lora_memory_bytes` (at the run's
    token capacity) shared by ``model_parallel`` ranks, above a rank's whole ``memory_bytes``. The run checks
    it before allocating anything, ``lorafusion submit`` before it answers."""
    from lorafusion.core.errors import ConfigError

    cap = int(token_capacity)
    need = lora_memory_bytes(spec, arch, cap) // model_parallel
    if need > memory_bytes:
        raise ConfigError(f"job {job!r}: lora.r = {spec.r}: its adapter needs about {need / 2**30:,.1f} GiB "
                          "a rank to train (weights, gradients, AdamW moments, activations at the token "
                          f"capacity {cap}), more than the {memory_bytes / 2**30:,.1f} GiB a rank of this "
                          "run has; lower lora.r")
