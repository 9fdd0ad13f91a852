"""A run continued as it was started: the effective config is recorded in the run directory at each start
(``RUN_DIR/run_config.json``: the YAML's config and the config with the command line's overrides, both
validated, paths absolute); ``train --resume`` starts from the recorded one and applies only what changed —
the run YAML's edits since then and the overrides given now — and names every change.

Configs are compared as flat dotted keys (``jobs.<name>.optimizer.lr``), jobs by name."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lorafusion.config.load import _apply_override, _check_files, _format_errors, _loc, load_run_config
from lorafusion.config.overrides import record_override
from lorafusion.config.schema import RunConfig
from lorafusion.config.yamlio import display
from lorafusion.core.errors import ConfigError

__all__ = ["RECORD_NAME", "config_record", "read_record", "resume_config"]

RECORD_NAME = "run_config.json"
_GONE = object()


def config_record(path: str | os.PathLike, overrides: Sequence[str], cfg: RunConfig) -> dict:
    """What a run records at start: the run YAML's own config (None when it is not valid without the
    overrides), the overrides and the effective config ``cfg`` (before any ``auto`` is resolved)."""
    try:
        own = load_run_config(path, (), check_files=False).model_dump(mode="json")
    except ConfigError:
        own = None
    return {"config_file": str(Path(path).resolve()), "overrides": list(overrides), "yaml": own,
            "effective": cfg.model_dump(mode="json")}


def read_record(run_dir: str | os.PathLike) -> dict | None:
    """The config record of the run in ``run_dir`` (None: a run from before records were kept, or none
    yet)."""
    file = Path(run_dir) / RECORD_NAME
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
        RunConfig.model_validate(record["effective"])
        return record
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{display(file)}: not a readable config record ({str(e).splitlines()[0]:.120}); "
                          f"resume without it by moving it away") from None


def _split(dump: dict) -> tuple[dict, dict[str, dict]]:
    """(run fields, {job name: job fields}), each flat: dotted keys to leaf values."""
    def flat(d: dict, prefix: str = "") -> dict:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    return flat({k: v for k, v in dump.items() if k != "jobs"}), {j["name"]: flat(j) for j in dump["jobs"]}


def _nest(flat: dict) -> dict:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        node = out
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = v
    return out


def _put(target: dict, key: str, value: Any) -> None:
    """Set (or with ``_GONE`` remove) ``key``, dropping what it replaces: a leaf above it or the keys below
    it."""
    for k in [k for k in target if k == key or k.startswith(key + ".") or key.startswith(k + ".")]:
        del target[k]
    if value is not _GONE:
        target[key] = value


def _carry(then: dict, now: dict, target: dict) -> None:
    """Every key whose value differs between ``then`` and ``now`` takes ``now``'s value in ``target``."""
    for key in sorted(set(then) | set(now)):
        if then.get(key, _GONE) != now.get(key, _GONE):
            _put(target, key, now.get(key, _GONE))


def _merge_yaml_edits(effective: dict, then: dict | None, now: dict) -> dict:
    """The recorded effective config with the run YAML's edits since the start (``then`` → ``now``)
    applied."""
    run, jobs = _split(effective)
    if then is None:  # (the YAML was not valid alone then: nothing to compare)
        return effective
    run_t, jobs_t = _split(then)
    run_n, jobs_n = _split(now)
    _carry(run_t, run_n, run)
    for name in jobs_t.keys() - jobs_n.keys():
        jobs.pop(name, None)
    for name, job in jobs_n.items():
        if name not in jobs_t or name not in jobs:
            jobs.setdefault(name, dict(job))
        else:
            _carry(jobs_t[name], job, jobs[name])
    return {**_nest(run), "jobs": [_nest(j) for j in jobs.values()]}


def _changes(before: dict, after: dict) -> list[str]:
    run_b, jobs_b = _split(before)
    run_a, jobs_a = _split(after)
    flat_b = {**run_b, **{f"jobs.{n}.{k}": v for n, j in jobs_b.items() for k, v in j.items()}}
    flat_a = {**run_a, **{f"jobs.{n}.{k}": v for n, j in jobs_a.items() for k, v in j.items()}}
    out = [f"jobs.{n}: added" for n in jobs_a.keys() - jobs_b.keys()]
    out += [f"jobs.{n}: removed" for n in jobs_b.keys() - jobs_a.keys()]
    for key in sorted(set(flat_b) | set(flat_a)):
        parts = key.split(".")
        if parts[0] == "jobs" and (parts[1] not in jobs_a or parts[1] not in jobs_b):
            continue
        b, a = flat_b.get(key, _GONE), flat_a.get(key, _GONE)
        if b != a:
            show = lambda v: "(unset)" if v is _GONE else json.dumps(v)  # noqa: E731
            out.append(f"{key}: {show(b)} -> {show(a)}")
    return out


def resume_config(path: str | os.PathLike, overrides: Sequence[str], record: dict,
                  check_files: bool = True) -> tuple[RunConfig, list[str]]:
    """The config a resumed run continues with: ``record``'s effective config, the run YAML's edits since it
    was recorded, then ``overrides`` (only what the user changes now); and the changes, one line each."""
    shown = display(Path(path))
    now = load_run_config(path, (), check_files=False).model_dump(mode="json")
    raw = _merge_yaml_edits(record["effective"], record.get("yaml"), now)
    names = [j.get("name") for j in raw["jobs"]]
    done: dict[str, str] = {}
    for item in overrides:
        try:
            record_override(done, _loc(_apply_override(raw, item, names)), item)
        except ConfigError as e:
            raise ConfigError(f"{shown}: {e}") from None
    locate = lambda loc: (shown, loc, " (in the config the run recorded at its start)")  # noqa: E731
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, locate)) from None
    cfg._source = shown
    if check_files:  # the data and model files it names, as a fresh start checks them
        _check_files(cfg, shown, {}, locate)
    return cfg, _changes(record["effective"], cfg.model_dump(mode="json"))
