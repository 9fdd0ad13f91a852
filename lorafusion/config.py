"""Run and job configuration (pydantic v2). The only place YAML is parsed.

A **run YAML** names the base model, tokenizer, parallelism, scheduler, kernels, output directory, seed,
logging and ``jobs``: a list whose items are paths of **job YAMLs** (relative to the run YAML's directory)
and/or inline job mappings. Relative ``dataset.path`` / ``model.path`` / ``tokenizer.path`` are resolved
against the directory of the YAML file that contains them and stored absolute.

Every problem is reported as one :class:`ConfigError` whose message names the file, the dotted field path
and what was expected, e.g. ``configs/quickstart/reverse.yaml: lora.r: expected an integer > 0, got 0``
(several problems: one line each, still one exception).

``key=value`` overrides (``scheduler.token_capacity=8192``, ``seed=3``, ``jobs.0.optimizer.lr=1e-4``;
``jobs.<name>.…`` works too) are applied to the loaded YAML before validation; values are parsed as YAML
scalars / flow collections; a key the schema does not have is an error. A relative path given by an
override is resolved against the current directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "DATASET_FILE_TYPES",
    "ConfigError",
    "DatasetConfig",
    "JobConfig",
    "LoRAConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "RunConfig",
    "SchedulerCfg",
    "TokenizerConfig",
    "load_job_config",
    "load_run_config",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the file, the dotted field path and what was expected."""


_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+$")
# extension → `datasets` builder name
DATASET_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _betas(v: Any) -> Any:
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ValueError(f"expected a list of two numbers [beta1, beta2], got {v!r}")
    return tuple(v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


# ----------------------------------------------------------------------------------------------- sections
class ModelConfig(_Strict):
    preset: str | None = None
    path: str | None = None  # HF model directory (config.json + safetensors)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    recompute: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        if (self.preset is None) == (self.path is None):
            raise ValueError("expected exactly one of `preset` (a preset name) or `path` (a HF model directory)")
        return self


class TokenizerConfig(_Strict):
    type: Literal["byte", "hf", "sentencepiece"] = "byte"
    # hf: a directory with tokenizer.json (default: model.path); sentencepiece: a .model file or a
    # directory holding tokenizer.model
    path: str | None = None


class ParallelismConfig(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def _capacity(v: Any) -> Any:
    if v == "auto" and isinstance(v, str):
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"expected a positive integer or 'auto', got {v!r}")
    return v


class SchedulerCfg(_Strict):
    token_capacity: Annotated[int | Literal["auto"], BeforeValidator(_capacity)] = 4096
    milp_time_limit_s: float = Field(1.0, gt=0)
    grouping: bool = True
    lookahead_batches: int = Field(2, ge=1)


class DatasetConfig(_Strict):
    path: str
    format: Literal["prompt_response", "chat", "text"]
    file_type: Literal["json", "jsonl", "parquet", "csv"] | None = None
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    text_field: str = "text"
    max_seq_len: int = Field(2048, ge=2)
    truncate: bool = False
    mask_prompt: bool = True

    @model_validator(mode="after")
    def _known_type(self):
        if self.file_type is None and Path(self.path).suffix.lower() not in DATASET_FILE_TYPES:
            raise ValueError(
                f"path: cannot tell the file type of {self.path!r} from its extension; expected one of "
                f"{', '.join(DATASET_FILE_TYPES)} or set dataset.file_type"
            )
        return self

    @property
    def builder(self) -> str:
        """The ``datasets`` builder name for this file ("json", "parquet" or "csv")."""
        if self.file_type is not None:
            return "json" if self.file_type == "jsonl" else self.file_type
        return DATASET_FILE_TYPES[Path(self.path).suffix.lower()]


def _resolve_targets(value):
    """``lorafusion.layers.targets.resolve_target_modules`` without importing megatron (the package
    ``lorafusion.layers`` imports it in its ``__init__``; targets.py itself is pure Python)."""
    mod = sys.modules.get("lorafusion.layers.targets")
    if mod is None:
        mod = sys.modules.get("lorafusion._config_targets")
    if mod is None:
        src = Path(__file__).resolve().parent / "layers" / "targets.py"
        spec = importlib.util.spec_from_file_location("lorafusion._config_targets", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["lorafusion._config_targets"] = mod
    return mod.resolve_target_modules(value, field="lora.target_modules")


class LoRAConfig(_Strict):
    r: int = Field(gt=0)
    lora_alpha: float = Field(gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str = "all-linear"
    use_rslora: bool = False
    # where this section came from, for errors raised by to_spec(): (file, dotted prefix)
    _source: tuple[str, str] = PrivateAttr(default=("<config>", "lora"))

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v):
        if not isinstance(v, str | list) or (isinstance(v, list) and not all(isinstance(x, str) for x in v)):
            raise ValueError(f"expected a module name or a list of module names, got {v!r}")
        try:
            _resolve_targets(v)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("lora.target_modules: ")) from None
        return v

    def to_spec(self):
        """The validated :class:`lorafusion.layers.adapter.LoRASpec` (imports the layers package)."""
        from lorafusion.layers.adapter import LoRASpec

        tm = (self.target_modules,) if isinstance(self.target_modules, str) else tuple(self.target_modules)
        try:
            return LoRASpec(r=self.r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                            target_modules=tm, use_rslora=self.use_rslora)
        except ValueError as e:
            file, prefix = self._source
            msg = str(e)
            if msg.startswith("lora."):
                msg = prefix + msg[len("lora"):]
            else:
                msg = f"{prefix}: {msg}"
            raise ConfigError(f"{file}: {msg}") from None


class OptimizerConfig(_Strict):
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: Annotated[tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]],
                     BeforeValidator(_betas)] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)


class JobConfig(_Strict):
    name: str
    dataset: DatasetConfig
    lora: LoRAConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    global_batch_size: int = Field(ge=1)  # samples per optimizer step
    max_steps: int | None = Field(None, ge=1)
    num_epochs: int | None = Field(None, ge=1)
    save_every: int | None = Field(None, ge=1)
    priority: int = 0

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"expected letters, digits, '_' or '-', got {v!r}")
        return v

    @model_validator(mode="after")
    def _stop_rule(self):
        if self.max_steps is None and self.num_epochs is None:
            raise ValueError("max_steps: expected max_steps or num_epochs (at least one), got neither")
        return self


class LoggingConfig(_Strict):
    tensorboard: bool = True
    progress: bool = True
    log_every: int = Field(1, ge=1)


class RunConfig(_Strict):
    model: ModelConfig
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    scheduler: SchedulerCfg = Field(default_factory=SchedulerCfg)
    kernels: Literal["auto", "fused", "reference"] = "auto"
    jobs: list[JobConfig] = Field(min_length=1)
    output_dir: str
    seed: int = Field(1234, ge=0)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _cross(self):
        seen: dict[str, int] = {}
        for i, job in enumerate(self.jobs):
            if job.name in seen:
                raise ValueError(f"jobs: duplicate job name {job.name!r} (jobs {seen[job.name]} and {i}); "
                                 f"expected unique names")
            seen[job.name] = i
        if self.tokenizer.type == "hf" and self.tokenizer.path is None and self.model.path is None:
            raise ValueError("tokenizer.path: expected a HF tokenizer directory (required when model.path "
                             "is not set)")
        if self.tokenizer.type == "sentencepiece" and self.tokenizer.path is None:
            raise ValueError("tokenizer.path: expected the sentencepiece model file")
        cap = self.scheduler.token_capacity
        if cap != "auto":
            for i, job in enumerate(self.jobs):
                if job.dataset.max_seq_len > cap:
                    raise ValueError(
                        f"jobs.{i}.dataset.max_seq_len: expected at most scheduler.token_capacity ({cap}) "
                        f"so every sample fits one microbatch, got {job.dataset.max_seq_len}")
        return self

    # the run YAML this came from (set by load_run_config), for errors raised after loading
    _source: str = PrivateAttr(default="<config>")

    def check_world_size(self, world_size: int) -> None:
        """ConfigError unless tp * pp * dp == world_size (the number of launched processes)."""
        p = self.parallelism
        if p.world_size != world_size:
            raise ConfigError(f"{self._source}: parallelism: expected tp * pp * dp = {world_size} (the number "
                              f"of processes launched), got {p.tp} * {p.pp} * {p.dp} = {p.world_size}")

    def job(self, name: str) -> JobConfig:
        for j in self.jobs:
            if j.name == name:
                return j
        raise KeyError(name)


# ----------------------------------------------------------------------------------------------- YAML
def _display(path: Path | str) -> str:
    p = Path(path)
    try:
        rel = os.path.relpath(p)
    except ValueError:
        return str(p)
    return str(p) if rel.startswith("..") else rel


class _UniqueKeyLoader:
    """A yaml SafeLoader that rejects duplicate keys in a mapping (built lazily to keep yaml local)."""

    _cls = None

    @classmethod
    def get(cls):
        if cls._cls is None:
            import yaml

            class Loader(yaml.SafeLoader):
                pass

            def construct_mapping(loader, node, deep=False):
                keys = set()
                for key_node, _ in node.value:
                    key = loader.construct_object(key_node, deep=deep)
                    if key in keys:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r}", key_node.start_mark)
                    keys.add(key)
                return yaml.SafeLoader.construct_mapping(loader, node, deep)

            Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
            # YAML 1.2 floats: PyYAML (YAML 1.1) reads `lr: 1e-4` as the string "1e-4"
            Loader.add_implicit_resolver(
                "tag:yaml.org,2002:float",
                re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                list("-+0123456789"))
            cls._cls = Loader
        return cls._cls


def _read_yaml(path: Path, what: str) -> dict:
    import yaml

    shown = _display(path)
    if not path.exists():
        raise ConfigError(f"{shown}: file not found (expected {what})")
    if not path.is_file():
        raise ConfigError(f"{shown}: not a file (expected {what})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{shown}: cannot read ({e})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader.get())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        ctx = getattr(e, "context", None)
        raise ConfigError(f"{shown}: {where}invalid YAML: {problem}" + (f" ({ctx})" if ctx else "")) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{shown}: expected a mapping ({what}) at the top level, got {got}")
    return data


# ----------------------------------------------------------------------------------------------- errors
def _loc(loc: Sequence[Any]) -> str:
    return ".".join(str(x) for x in loc)


def _fmt_input(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _kind(v: Any) -> str:
    return "an integer" if isinstance(v, int) and not isinstance(v, bool) else "a number"


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
    if t in ("float_type", "float_parsing"):
        return "expected a number" + got
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
        return f"expected {_kind(v)} > {ctx['gt']}" + got
    if t == "greater_than_equal":
        return f"expected {_kind(v)} >= {ctx['ge']}" + got
    if t == "less_than":
        return f"expected {_kind(v)} < {ctx['lt']}" + got
    if t == "less_than_equal":
        return f"expected {_kind(v)} <= {ctx['le']}" + got
    if t == "too_short":
        return f"expected at least {ctx.get('min_length', 1)} item(s)" + got
    if t == "too_long":
        return f"expected at most {ctx.get('max_length')} item(s)" + got
    if t == "value_error":
        msg = str(ctx.get("error", err["msg"]))
        return msg.removeprefix("Value error, ")
    return err["msg"] + got


def _format_errors(exc: ValidationError, locate) -> str:
    """``locate(loc) -> (file, loc_in_file, note)``; one line per error, deduplicated."""
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
            lines.append(f"{file}: {where}unknown key {key!r}{_allowed(loc[:-1])}{note}")
        else:
            lines.append(f"{file}: {_loc(inner) or '(top level)'}: {msg}{note}")
    return "\n".join(dict.fromkeys(lines))


_FIELD_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*): (.*)$", re.DOTALL)


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model class at a dotted location of RunConfig (None when not a model)."""
    model: Any = RunConfig
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
    if origin is Annotated:
        return _unwrap(get_args(ann)[0])
    if origin in (list, tuple):
        return _unwrap(get_args(ann)[0])
    if origin is not None:  # Union
        for a in get_args(ann):
            u = _unwrap(a)
            if isinstance(u, type) and issubclass(u, BaseModel):
                return u
        return ann
    return ann


def _allowed(loc: Sequence[Any]) -> str:
    m = _model_at(loc)
    if m is None:
        return ""
    return f"; expected one of: {', '.join(m.model_fields)}"


# ----------------------------------------------------------------------------------------------- paths
def _resolve_path(value: Any, base: Path) -> Any:
    """Absolute form of a path written in a YAML file (``~`` expanded; relative → against ``base``)."""
    if isinstance(value, str) and value:
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else (base / p).resolve())
    return value


def _resolve_job_paths(job: Any, base: Path) -> None:
    if isinstance(job, dict) and isinstance(job.get("dataset"), dict) and "path" in job["dataset"]:
        job["dataset"]["path"] = _resolve_path(job["dataset"]["path"], base)


def _resolve_run_paths(raw: dict, base: Path) -> None:
    for section in ("model", "tokenizer"):
        if isinstance(raw.get(section), dict) and "path" in raw[section]:
            raw[section]["path"] = _resolve_path(raw[section]["path"], base)


# ----------------------------------------------------------------------------------------------- overrides
def _parse_override(item: str) -> tuple[list[str], Any]:
    import yaml

    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. scheduler.token_capacity=8192)")
    key, _, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {item!r}: expected a dotted key such as jobs.0.optimizer.lr")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader.get()) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({getattr(e, 'problem', e)})") from None
    return parts, value


def _apply_override(raw: dict, item: str, job_names: list[Any]) -> list[Any]:
    """Set a dotted key in ``raw`` (validated against the schema); returns the resolved location."""
    parts, value = _parse_override(item)
    model: Any = RunConfig
    node: Any = raw
    loc: list[Any] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"override {item!r}: {_loc(loc)} has no sub-keys")
        if part not in model.model_fields:
            where = f"{_loc(loc)}." if loc else ""
            raise ConfigError(f"override {item!r}: unknown key {where}{part}; expected one of: "
                              f"{', '.join(model.model_fields)}")
        loc.append(part)
        ann = model.model_fields[part].annotation
        if part == "jobs" and model is RunConfig:
            if last:
                raise ConfigError(f"override {item!r}: cannot replace the whole job list; set jobs.<i>.<key>")
            sel = parts[i + 1]
            jobs = node.get("jobs")
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
            return _apply_in_job(jobs[idx], parts[i + 2:], value, item, ["jobs", idx])
        if last:
            node[part] = _maybe_path(parts, value)
            return loc
        sub = node.get(part)
        if sub is None:
            sub = node[part] = {}
        if not isinstance(sub, dict):
            raise ConfigError(f"override {item!r}: {_loc(loc)} is not a mapping in the config")
        node, model = sub, _unwrap(ann)
    return loc


def _apply_in_job(job: dict, parts: list[str], value: Any, item: str, loc: list[Any]) -> list[Any]:
    if not parts:
        raise ConfigError(f"override {item!r}: expected a key inside the job, e.g. {_loc(loc)}.optimizer.lr")
    model: Any = JobConfig
    node = job
    for i, part in enumerate(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"override {item!r}: {_loc(loc)} has no sub-keys")
        if part not in model.model_fields:
            raise ConfigError(f"override {item!r}: unknown key {_loc(loc + [part])}; expected one of: "
                              f"{', '.join(model.model_fields)}")
        loc.append(part)
        if i == len(parts) - 1:
            node[part] = _maybe_path(parts, value)
            return loc
        sub = node.get(part)
        if sub is None:
            sub = node[part] = {}
        if not isinstance(sub, dict):
            raise ConfigError(f"override {item!r}: {_loc(loc)} is not a mapping in the config")
        node, model = sub, _unwrap(model.model_fields[part].annotation)
    return loc


def _maybe_path(parts: list[str], value: Any) -> Any:
    if parts[-1] == "path" and len(parts) >= 2 and parts[-2] in ("dataset", "model", "tokenizer"):
        return _resolve_path(value, Path.cwd())
    return value


# ----------------------------------------------------------------------------------------------- loading
def load_run_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a run YAML (and the job YAMLs it lists), apply ``key=value`` overrides, validate.

    Raises :class:`ConfigError` (one exception; its message names file, field and expectation).
    """
    run_path = Path(path)
    run_abs = run_path.resolve()
    run_shown = _display(run_path)
    raw = _read_yaml(run_path, "a run config")
    _resolve_run_paths(raw, run_abs.parent)

    # job sources: index → (display file, prefix inside that file)
    sources: dict[int, tuple[str, list[Any]]] = {}
    jobs = raw.get("jobs")
    if isinstance(jobs, list):
        loaded = []
        for i, item in enumerate(jobs):
            if isinstance(item, str):
                jpath = Path(_resolve_path(item, run_abs.parent))
                if not jpath.exists():
                    raise ConfigError(f"{run_shown}: jobs.{i}: file not found: {_display(jpath)} "
                                      f"(expected a job YAML, relative to {_display(run_abs.parent) or '.'})")
                job = _read_yaml(jpath, "an adapter job")
                _resolve_job_paths(job, jpath.parent)
                sources[i] = (_display(jpath), [])
                loaded.append(job)
            else:
                _resolve_job_paths(item, run_abs.parent)
                loaded.append(item)
        raw["jobs"] = loaded

    def names() -> list[Any]:
        js = raw.get("jobs")
        return [j.get("name") if isinstance(j, dict) else None for j in js] if isinstance(js, list) else []

    overridden: dict[str, str] = {}
    for item in overrides:
        try:
            loc = _apply_override(raw, item, names())
        except ConfigError as e:
            raise ConfigError(f"{run_shown}: {e}") from None
        overridden[_loc(loc)] = item

    # duplicate names named with both files before pydantic sees them
    seen: dict[str, int] = {}
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
                note = f" (set by override {ov!r})"
        if len(loc) >= 2 and loc[0] == "jobs" and isinstance(loc[1], int) and loc[1] in sources:
            return sources[loc[1]][0], loc[2:], note
        return run_shown, loc, note

    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, locate)) from None

    cfg._source = run_shown
    for i, job in enumerate(cfg.jobs):
        file = sources[i][0] if i in sources else run_shown
        job.lora._source = (file, "lora" if i in sources else f"jobs.{i}.lora")
    _check_files(cfg, run_shown, sources, locate)
    return cfg


def _check_files(cfg: RunConfig, run_shown: str, sources, locate) -> None:
    """Files the config names must exist (checked here so `plan` fails before any work)."""
    if cfg.model.preset is not None:
        try:
            from lorafusion.models.spec import PRESETS
        except ImportError:  # pragma: no cover - torch missing
            PRESETS = None
        if PRESETS is not None and cfg.model.preset not in PRESETS:
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
    for i, job in enumerate(cfg.jobs):
        p = Path(job.dataset.path)
        if not p.is_file():
            file, inner, note = locate(["jobs", i, "dataset", "path"])
            raise ConfigError(f"{file}: {_loc(inner)}: dataset file "
                              f"{'not found' if not p.exists() else 'is not a file'}: {_display(p)}{note}")


def load_job_config(path: str | os.PathLike) -> JobConfig:
    """Read and validate one job YAML on its own (relative dataset path resolved against its directory)."""
    jpath = Path(path)
    shown = _display(jpath)
    raw = _read_yaml(jpath, "an adapter job")
    _resolve_job_paths(raw, jpath.resolve().parent)
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, lambda loc: (shown, loc, ""))) from None
    job.lora._source = (shown, "lora")
    return job
