"""``key=value`` overrides of a run or job YAML (applied by :mod:`.load`): one parsed, and each key given
once."""

from __future__ import annotations

from typing import Any

from lorafusion.config.yamlio import load_bounded
from lorafusion.core.errors import ConfigError


def parse_override(item: str) -> tuple[list[str], Any]:
    import yaml

    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. scheduler.token_capacity=8192)")
    key, _, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {item!r}: expected a dotted key such as jobs.0.optimizer.lr")
    try:
        value = load_bounded(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item[:80]!r}: value is not valid YAML "
                          f"({getattr(e, 'problem', e)})") from None
    return parts, value


def record_override(done: dict[str, str], key: str, item: str) -> None:
    """Note that override ``item`` set the dotted ``key`` (resolved: ``jobs.rev.seed`` is ``jobs.0.seed``); a
    key set twice, or inside or around one already set (``lora={r: 4} lora.r=8``), is refused: the last would
    win silently."""
    for k, ov in done.items():
        if k == key or k.startswith(key + ".") or key.startswith(k + "."):
            raise ConfigError(
                f"override {item!r}: {key} is already set by override {ov!r}; give each key once")
    done[key] = item
