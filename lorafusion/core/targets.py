"""``target_modules`` → Megatron linear names. Only mappings that are exact are accepted."""

from __future__ import annotations

from collections.abc import Iterable

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# PEFT (HF LLaMA/Qwen2) module names grouped by the fused Megatron linear they live in.
PEFT_GROUPS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
PEFT_TO_MEGATRON = {p: m for m, ps in PEFT_GROUPS.items() for p in ps}
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")


def resolve_target_modules(target_modules: str | Iterable[str],
                           field: str = "lora.target_modules") -> tuple[str, ...]:
    """The normal form of Megatron names, PEFT names or ``"all-linear"``, in layer order: a Megatron linear
    targeted whole is its Megatron name (``linear_qkv``); a subset of a fused linear's projections is those
    PEFT names (``q_proj``, ``v_proj``: each has its own A and B, PEFT's semantics)."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if not names:
        raise ValueError(f"{field}: expected at least one module name, got an empty list")
    chosen: set[str] = set()
    peft_seen: set[str] = set()
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{field}: expected module names as strings, got {name!r}")
        if name == "all-linear":
            chosen.update(MEGATRON_TARGETS)
        elif name in MEGATRON_TARGETS:
            chosen.add(name)
        elif name in PEFT_TO_MEGATRON:
            peft_seen.add(name)
        else:
            raise ValueError(
                f"{field}: unknown module {name!r}; expected Megatron names {list(MEGATRON_TARGETS)}, "
                f"PEFT names {sorted(PEFT_TO_MEGATRON)} or 'all-linear'"
            )
    out: list[str] = []
    for meg, group in PEFT_GROUPS.items():
        present = [p for p in group if p in peft_seen]
        if meg in chosen or len(present) == len(group):
            out.append(meg)
        else:
            out.extend(present)
    return tuple(out)


def projections(targets: Iterable[str], kind: str) -> tuple[str, ...]:
    """The PEFT projections of Megatron linear ``kind`` that normalised ``targets`` name (all of its group
    when ``kind`` itself is named, () when none)."""
    targets = tuple(targets)
    if kind in targets:
        return PEFT_GROUPS[kind]
    return tuple(p for p in PEFT_GROUPS[kind] if p in targets)


def megatron_targets(targets: Iterable[str]) -> tuple[str, ...]:
    """The Megatron linears that normalised ``targets`` touch, in layer order."""
    targets = tuple(targets)
    return tuple(m for m in MEGATRON_TARGETS if projections(targets, m))


def partial_groups(targets: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """{fused Megatron linear: its targeted projections} for the fused linears targeted only in part."""
    targets = tuple(targets)
    return {m: projections(targets, m) for m in COLUMN_PARALLEL
            if projections(targets, m) and m not in targets}


def to_peft_target_modules(targets: Iterable[str]) -> list[str]:
    """The PEFT ``target_modules`` list equivalent to normalised (or Megatron) targets."""
    targets = tuple(targets)
    return [p for m in MEGATRON_TARGETS for p in projections(targets, m)]
