"""A job's ``init_from``: the PEFT adapter it starts from (continued training of an adapter made anywhere).

The adapter's ``adapter_config.json`` fills the keys the job's ``lora`` section leaves out (before
validation), and the keys it sets must agree with the adapter's (after validation; one error naming the field
otherwise). ``lora_dropout`` and ``shared_fused_a`` are the job's own (dropout acts only in training; with
``shared_fused_a: true`` the adapter's q/k/v and gate/up A must be identical, checked when it is loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafusion.core.errors import ConfigError, UserError
from lorafusion.core.peft_config import COMPARED, read_peft_config

__all__ = ["check_init_from", "fill_lora_from_init"]

Locate = Callable[[list[Any]], tuple[str, list[Any], str]]
_FILLED = ("r", "lora_alpha", "target_modules", "use_rslora", "lora_dropout")


def _adapter_spec(path: Path, loc: list[Any], locate: Locate):
    file, inner, note = locate([*loc, "init_from"])
    field = ".".join(str(x) for x in inner)
    missing = [n for n in ("adapter_config.json", "adapter_model.safetensors") if not (path / n).is_file()]
    if missing:
        raise ConfigError(f"{file}: {field}: expected a PEFT adapter directory, {' and '.join(missing)} not "
                          f"found in {path}{note}")
    try:
        return read_peft_config(path)[1]
    except UserError as e:
        raise ConfigError(f"{file}: {field}: {e}{note}") from None


def fill_lora_from_init(job: Any, loc: list[Any], locate: Locate) -> None:
    """A raw job mapping with ``init_from``: the adapter must be loadable (one error naming the field), and
    the ``lora`` keys the job leaves out are taken from it."""
    if not isinstance(job, dict) or not isinstance(job.get("init_from"), str):
        return
    spec = _adapter_spec(Path(job["init_from"]), loc, locate)
    lora = job.setdefault("lora", {})
    if not isinstance(lora, dict):
        return
    for key in _FILLED:
        if key not in lora:
            value = getattr(spec, key)
            lora[key] = list(value) if isinstance(value, tuple) else value


def check_init_from(job, loc: list[Any], locate: Locate) -> None:
    """A validated job's ``lora`` agrees with the adapter in its ``init_from``."""
    if job.init_from is None:
        return
    path = Path(job.init_from)
    spec = _adapter_spec(path, loc, locate)
    for key in COMPARED:
        ours, theirs = getattr(job.lora, key), getattr(spec, key)
        if ours != theirs:
            file, inner, note = locate([*loc, "lora", key])
            raise ConfigError(f"{file}: {'.'.join(str(x) for x in inner)}: the adapter in init_from ({path}) "
                              f"has {list(theirs) if isinstance(theirs, tuple) else theirs!r}, the job "
                              f"{list(ours) if isinstance(ours, tuple) else ours!r}; leave it out of lora to "
                              f"take the adapter's, or start without init_from{note}")
