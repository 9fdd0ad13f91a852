"""Reading run and job YAMLs (parsed by :mod:`.yamlio`, the only place YAML is parsed).

A **run YAML** lists its jobs as paths of **job YAMLs** (relative to the run YAML's directory) and/or inline
job mappings. Relative ``dataset.path`` / ``model.path`` / ``tokenizer.path`` / ``output_dir`` are resolved
against the directory of the YAML file that contains them and stored absolute.

Every problem is reported as one :class:`ConfigError` whose message names the file, the dotted field path
and what was expected, e.g. ``configs/quickstart/reverse.yaml: lora.r: expected an integer > 0, got 0``
(several problems: one line each, still one exception).

``key=value`` overrides (``seed=3``, ``jobs.0.optimizer.lr=1e-4``, ``jobs.<name>.…``) are applied before
validation, values parsed as YAML; an unknown key is an error; a relative path in one is resolved against the
current directory. (OmegaConf's dotlist merge needs the same schema walk for job names, paths, errors.)"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from lorafusion.config.schema import JobConfig, RunConfig
from lorafusion.config.yamlio import display as _display, read_yaml as _read_yaml
from lorafusion.config.yamlio import resolve_path as _resolve_path
from lorafusion.config.init_from import check_init_from, fill_lora_from_init
from lorafusion.config.overrides import parse_override as _parse_override, record_override
from lorafusion.core.arch import PRESETS
from lorafusion.core.errors import ConfigError

__all__ = ["job_config_from", "load_job_config", "load_run_config"]


# ----------------------------------------------------------------------------------------------- errors
def _loc(loc: Sequence[Any]) -> str:
    return ".".join(str(x) for x in loc)


def _fmt_input(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _kind(v: Any, bound: Any) -> str:
    """'an integer' for an integer field (its bound is an int), else 'a number' (a float given 0 too)."""
    return "an integer" if (isinstance(bound, int) and isinstance(v, int)
                            and not isinstance(v, bool)) else "a number"


def _explain(err: dict) -> str:
    """pydantic error dict → 'expected …, got …'."""
    t, ctx, v = err["type"], err.get("ctx") or {}, err.get("input")
    got = f", got {_fmt_input(v)}"
    if t == "missing":
        return "required field is missing"
    if t == "extra_forbidden":
        return "unknown key"
    if t in ("int_type", "int_parsing", "int_from_float"):
        return "expected an integer" + got
    if t in ("float_type", "float_parsing", "finite_number"):
        return f"expected a {'finite ' * (t == 'finite_number')}number" + got
    if t in ("bool_type", "bool_parsing"):
        return "expected true or false" + got
    if t in ("string_type", "str_type"):
        return "expected a string" + got
    if t in ("model_type", "model_attributes_type", "dict_type"):
        return "expected a mapping" + got
    if t in ("list_type", "tuple_type"):
        return "expected a list" + got
    if t == "literal_error":
        return f"expected one of {ctx.get('expected', '')}" + got
    if t == "greater_than":
        return f"expected {_kind(v, ctx['gt'])} > {ctx['gt']}" + got
    if t == "greater_than_equal":
        return f"expected {_kind(v, ctx['ge'])} >= {ctx['ge']}" + got
    if t == "less_than":
        return f"expected {_kind(v, ctx['lt'])} < {ctx['lt']}" + got
    if t == "less_than_equal":
        return f"expected {_kind(v, ctx['le'])} <= {ctx['le']}" + got
    if t == "too_short":
        return f"expected at least {ctx.get('min_length', 1)} item(s)" + got
    if t == "too_long":
        return f"expected at most {ctx.get('max_length')} item(s)" + got
    if t == "value_error":
        msg = str(ctx.get("error", err["msg"]))
        return msg.removeprefix("Value error, ")
    return err["msg"] + got


def _format_errors(exc: ValidationError, locate, root: type[BaseModel] | None = None) -> str:
    """``locate(loc) -> (file, loc_in_file, note)``; one line per error, deduplicated; loc from ``root``."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = list(err["loc"])
        msg = _explain(err)
        # a section's validator may name the sub-field itself: "path: ...", "jobs.1.dataset.max_seq_len: ..."
        m = _FIELD_PREFIX.match(msg)
        if err["type"] == "value_error" and m:
            loc += [int(x) if x.isdigit() else x for x in m.group(1).split(".")]
            msg = m.group(2)
        file, inner, note = locate(loc)
        if err["type"] == "extra_forbidden":
            parent = inner[:-1]
            where = f"{_loc(parent)}: " if parent else ""
            key = str(inner[-1]) if inner else "?"
            lines.append(f"{file}: {where}unknown key {key!r}{_allowed(loc[:-1], root or RunConfig)}{note}")
        else:
            lines.append(f"{file}: {_loc(inner) or '(top level)'}: {msg}{note}")
    return "\n".join(dict.fromkeys(lines))


_FIELD_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*): (.*)$", re.DOTALL)


def _model_at(loc: Sequence[Any], root: type[BaseModel] = RunConfig) -> type[BaseModel] | None:
    """The pydantic model class at a dotted location of ``root`` (None when not a model)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(ann: Any) -> Any:
    """Strip Optional/list/Annotated to the inner model type, if any."""
    origin = get_origin(ann)
    if origin is Annotated or origin in (list, tuple):
        return _unwrap(get_args(ann)[0])
    if origin is not None:  # Union
        for a in get_args(ann):
            u = _unwrap(a)
            if isinstance(u, type) and issubclass(u, BaseModel):
                return u
        return ann
    return ann


def _allowed(loc: Sequence[Any], root: type[BaseModel] = RunConfig) -> str:
    m = _model_at(loc, root)
    return "" if m is None else f"; expected one of: {', '.join(m.model_fields)}"


# ----------------------------------------------------------------------------------------------- paths
def _resolve_job_paths(job: Any, base: Path, where: str = "") -> None:
    for key in ("dataset", "eval_dataset"):
        if isinstance(job, dict) and isinstance(job.get(key), dict) and "path" in job[key]:
            job[key]["path"] = _resolve_path(job[key]["path"], base, f"{where}{key}.path: ")
    if isinstance(job, dict) and isinstance(job.get("init_from"), str):
        job["init_from"] = _resolve_path(job["init_from"], base, f"{where}init_from: ")


def _resolve_run_paths(raw: dict, base: Path, shown: str) -> None:
    if isinstance(raw.get("output_dir"), str):  # the same rule as every other path in a YAML
        raw["output_dir"] = _resolve_path(raw["output_dir"], base, f"{shown}: output_dir: ")
    for section in ("model", "tokenizer"):
        if isinstance(raw.get(section), dict) and "path" in raw[section]:
            raw[section]["path"] = _resolve_path(raw[section]["path"], base, f"{shown}: {section}.path: ")


# ----------------------------------------------------------------------------------------------- overrides
def _apply_override(raw: dict, item: str, job_names: list[Any],
                    root: type[BaseModel] = RunConfig) -> list[Any]:
    """Set a dotted key in ``raw`` (checked against the schema ``root``); returns the resolved location.
    ``jobs.<i>`` or ``jobs.<name>`` selects a job of a run."""
    parts, value = _parse_override(item)
    model: Any = root
    node: Any = raw
    loc: list[Any] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"override {item!r}: {_loc(loc)} has no sub-keys")
        if part not in model.model_fields:
            raise ConfigError(f"override {item!r}: unknown key {_loc(loc + [part])}; expected one of: "
                              f"{', '.join(model.model_fields)}")
        if part == "jobs" and model is RunConfig:
            node, loc = _select_job(node, parts, i, item, job_names)
            model = JobConfig
            i += 2
            if i == len(parts):
                raise ConfigError(f"override {item!r}: expected a key inside the job, e.g. "
                                  f"{_loc(loc)}.optimizer.lr")
            continue
        loc.append(part)
        if i == len(parts) - 1:
            node[part] = _maybe_path(parts, value, f"override {item!r}: ")
            return loc
        sub = node.get(part)
        if sub is None:
            sub = node[part] = {}
        if not isinstance(sub, dict):
            raise ConfigError(f"override {item!r}: {_loc(loc)} is not a mapping in the config")
        node, model = sub, _unwrap(model.model_fields[part].annotation)
        i += 1
    return loc


def _select_job(raw: dict, parts: list[str], i: int, item: str,
                job_names: list[Any]) -> tuple[dict, list[Any]]:
    """The job mapping that ``jobs.<index or name>`` (at ``parts[i:i + 2]``) names, and its location."""
    if i == len(parts) - 1:
        raise ConfigError(f"override {item!r}: cannot replace the whole job list; set jobs.<i>.<key>")
    sel = parts[i + 1]
    jobs = raw.get("jobs")
    if not isinstance(jobs, list):
        raise ConfigError(f"override {item!r}: the run config has no job list")
    if sel.isdigit():
        idx = int(sel)
    elif sel in job_names:
        idx = job_names.index(sel)
    else:
        raise ConfigError(f"override {item!r}: no job {sel!r}; expected an index 0..{len(jobs) - 1} "
                          f"or one of the job names {[n for n in job_names if isinstance(n, str)]}")
    if idx >= len(jobs):
        raise ConfigError(f"override {item!r}: job index {idx} out of range (the run has "
                          f"{len(jobs)} job(s))")
    if not isinstance(jobs[idx], dict):
        raise ConfigError(f"override {item!r}: job {idx} is not a mapping")
    return jobs[idx], ["jobs", idx]


def _maybe_path(parts: list[str], value: Any, where: str) -> Any:
    if parts[-1] == "path" and len(parts) >= 2 and parts[-2] in ("dataset", "eval_dataset", "model",
                                                                 "tokenizer") \
            or parts == ["output_dir"] or parts[-1] == "init_from":
        return _resolve_path(value, Path.cwd(), where)
    return value


def _load_jobs(raw: dict, run_abs: Path, run_shown: str) -> dict[int, tuple[str, list[Any]]]:
    """Replace each job of ``raw["jobs"]`` given as a file by that job YAML's contents (paths resolved against
    it; inline jobs against the run YAML). Returns the job sources: index → (display file, prefix in it)."""
    sources: dict[int, tuple[str, list[Any]]] = {}
    jobs = raw.get("jobs")
    if not isinstance(jobs, list):
        return sources
    loaded = []
    for i, item in enumerate(jobs):
        if isinstance(item, str):
            jpath = Path(_resolve_path(item, run_abs.parent, f"{run_shown}: jobs.{i}: "))
            if not jpath.exists():
                raise ConfigError(f"{run_shown}: jobs.{i}: file not found: {_display(jpath)} "
                                  f"(expected a job YAML, relative to {_display(run_abs.parent) or '.'})")
            job = _read_yaml(jpath, "an adapter job")
            _resolve_job_paths(job, jpath.parent, f"{_display(jpath)}: ")
            sources[i] = (_display(jpath), [])
            loaded.append(job)
        else:
            _resolve_job_paths(item, run_abs.parent, f"{run_shown}: jobs.{i}.")
            loaded.append(item)
    raw["jobs"] = loaded
    return sources


# ----------------------------------------------------------------------------------------------- loading
def load_run_config(path: str | os.PathLike, overrides: Sequence[str] = (),
                    check_files: bool = True) -> RunConfig:
    """Read a run YAML (and its job YAMLs), apply ``key=value`` overrides, validate (files: check_files).
    Raises :class:`ConfigError` (one exception; its message names file, field and expectation)."""
    run_path = Path(path)
    run_shown = _display(run_path)
    raw = _read_yaml(run_path, "a run config")
    run_abs = run_path.resolve()
    _resolve_run_paths(raw, run_abs.parent, run_shown)

    sources = _load_jobs(raw, run_abs, run_shown)

    def names() -> list[Any]:
        js = raw.get("jobs")
        return [j.get("name") if isinstance(j, dict) else None for j in js] if isinstance(js, list) else []

    overridden: dict[str, str] = {}
    for item in overrides:
        try:
            record_override(overridden, _loc(_apply_override(raw, item, names())), item)
        except ConfigError as e:
            raise ConfigError(f"{run_shown}: {e}") from None

    seen: dict[str, int] = {}  # duplicate names named with both files before pydantic sees them
    for i, n in enumerate(names()):
        if isinstance(n, str):
            if n in seen:
                a, b = seen[n], i
                fa = sources.get(a, (run_shown, None))[0]
                fb = sources.get(b, (run_shown, None))[0]
                raise ConfigError(f"{run_shown}: jobs: duplicate job name {n!r} (jobs.{a} in {fa} and "
                                  f"jobs.{b} in {fb}); expected unique names")
            seen[n] = i

    def locate(loc: list[Any]) -> tuple[str, list[Any], str]:
        key = _loc(loc)
        note = ""
        for k, ov in overridden.items():
            if key == k or key.startswith(k + "."):
                note = f" (set by override {_fmt_input(ov)})"
        if len(loc) >= 2 and loc[0] == "jobs" and isinstance(loc[1], int) and loc[1] in sources:
            return sources[loc[1]][0], loc[2:], note
        return run_shown, loc, note

    for i, job in enumerate(raw.get("jobs") if isinstance(raw.get("jobs"), list) else []):
        fill_lora_from_init(job, ["jobs", i], locate)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, locate)) from None

    cfg._source = run_shown
    _check_files(cfg, run_shown, sources, locate) if check_files else None
    return cfg


def _check_files(cfg: RunConfig, run_shown: str, sources, locate) -> None:
    """Files the config names must exist (checked here so `plan` fails before any work)."""
    if cfg.model.preset is not None:
        if cfg.model.preset not in PRESETS:
            raise ConfigError(f"{run_shown}: model.preset: expected one of {sorted(PRESETS)}, "
                              f"got {cfg.model.preset!r}")
    if cfg.model.path is not None:
        p = Path(cfg.model.path)
        if not p.is_dir():
            raise ConfigError(f"{run_shown}: model.path: expected a HF model directory, "
                              f"{'not found' if not p.exists() else 'not a directory'}: {_display(p)}")
        if not (p / "config.json").is_file():
            raise ConfigError(f"{run_shown}: model.path: no config.json in {_display(p)}")
    tok = cfg.tokenizer
    if tok.type == "hf":
        d = Path(tok.path or cfg.model.path)
        field = "tokenizer.path" if tok.path else "model.path (used as tokenizer.path)"
        if not (d / "tokenizer.json").is_file():
            raise ConfigError(f"{run_shown}: {field}: expected a directory with tokenizer.json, "
                              f"not found: {_display(d / 'tokenizer.json')}")
    elif tok.type == "sentencepiece":
        p = Path(tok.path)
        if not (p.is_file() or (p / "tokenizer.model").is_file()):
            raise ConfigError(f"{run_shown}: tokenizer.path: expected a sentencepiece model file (or a "
                              f"directory with tokenizer.model), not found: {_display(p)}")
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{run_shown}: output_dir: expected a directory (or a path to create), "
                          f"but {_display(out)} is a file{locate(['output_dir'])[2]}")
    for i, job in enumerate(cfg.jobs):
        check_init_from(job, ["jobs", i], locate)
        for key, ds in (("dataset", job.dataset), ("eval_dataset", job.eval_dataset)):
            if ds is not None and not (p := Path(ds.path)).is_file():
                file, inner, note = locate(["jobs", i, key, "path"])
                from lorafusion.core.lengths import bench_data_hint
                raise ConfigError(f"{file}: {_loc(inner)}: dataset file "
                                  f"{'not found' if not p.exists() else 'is not a file'}: "
                                  f"{_display(p)}{note}{bench_data_hint(_display(p))}")


def load_job_config(path: str | os.PathLike, overrides: Sequence[str] = (), *,
                    check_files: bool = False) -> JobConfig:
    """One job YAML on its own (dataset path relative to it), with ``key=value`` overrides of its keys (e.g.
    ``optimizer.lr=1e-4``); ``check_files``: its dataset file must exist."""
    jpath = Path(path)
    shown = _display(jpath)
    raw = _read_yaml(jpath, "an adapter job")
    if isinstance(raw, dict) and "jobs" in raw and "name" not in raw:  # (one line, not one per run key)
        raise ConfigError(
            f"{shown}: is a run config (it lists jobs); expected one adapter job's YAML (name, ...)")
    _resolve_job_paths(raw, jpath.resolve().parent, f"{shown}: ")
    overridden: dict[str, str] = {}
    for item in overrides:  # the keys as the user typed them, e.g. optimizer.lr (not jobs.0.optimizer.lr)
        try:
            record_override(overridden, _loc(_apply_override(raw, item, [], root=JobConfig)), item)
        except ConfigError as e:
            raise ConfigError(f"{shown}: {e}") from None

    def locate(loc: list[Any]) -> tuple[str, list[Any], str]:  # (the note: the override that set the field)
        hits = [ov for k, ov in overridden.items() if _loc(loc) == k or _loc(loc).startswith(k + ".")]
        return shown, loc, f" (set by override {_fmt_input(hits[-1])})" if hits else ""

    fill_lora_from_init(raw, [], locate)
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, locate, JobConfig)) from None
    check_init_from(job, [], locate)
    for key, ds in (("dataset", job.dataset), ("eval_dataset", job.eval_dataset)):
        if check_files and ds is not None and not Path(ds.path).is_file():
            raise ConfigError(f"{shown}: {key}.path: dataset file not found: {_display(Path(ds.path))}")
    return job


def job_config_from(raw: Any, shown: str) -> JobConfig:
    """A job mapping that did not come from a YAML file (a submit request's) validated like one: one
    :class:`ConfigError` whose lines name ``shown`` and the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{shown}: expected a job mapping, got {type(raw).__name__}")
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, lambda loc: (shown, loc, ""), JobConfig)) from None
