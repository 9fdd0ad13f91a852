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


def resolve_target_modules(target_modules: str | Iterable[str], field: str = "lora.target_modules") -> tuple[str, ...]:
    """Megatron names (sorted in layer order) for Megatron names, PEFT names or ``"all-linear"``.

    PEFT names that are fused in Megatron must come together ({q,k,v}_proj, {gate,up}_proj): a subset
    cannot be represented exactly by one low-rank update of the fused weight, so it is an error.
    """
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
    for meg, group in PEFT_GROUPS.items():
        present = [p for p in group if p in peft_seen]
        if present and len(present) != len(group):
            raise ValueError(
                f"{field}: {'/'.join(group)} are fused into {meg} and must be targeted together "
                f"(got only {', '.join(present)}); a subset has no exact LoRA on the fused weight"
            )
        if present:
            chosen.add(meg)
    return tuple(m for m in MEGATRON_TARGETS if m in chosen)


def to_peft_target_modules(megatron_targets: Iterable[str]) -> list[str]:
    """The PEFT ``target_modules`` list equivalent to Megatron targets."""
    out: list[str] = []
    for m in MEGATRON_TARGETS:
        if m in megatron_targets:
            out.extend(PEFT_GROUPS[m])
    return out
