"""Arrival traces of LoRA jobs (torch-free): read, validate, write, generate, turn into ``JobSpec``.

A trace is a YAML file with a ``jobs:`` list (optional ``seed:``, ``note:``), or a JSONL file with one job
object per line. Each job has the fields of a run config's job that matter for scheduling, plus its
arrival time::

    jobs:
      - name: j00
        arrival_s: 0.0                      # seconds after the trace starts
        dataset: {profile: medium}          # or {path: data/x.jsonl} (relative to the trace file)
        lora: {r: 16}
        global_batch_size: 16
        max_steps: 50
        priority: 0                         # optional, higher first
        seed: 7                             # optional: sample-length seed of a profile dataset

Any bad field raises one :class:`TraceError` naming the file and the field (``f.yaml: jobs[3].max_steps:
...``). Profile datasets draw sample lengths from the bench data profiles (:data:`LENGTH_PROFILES`,
in ``lorafusion.core.lengths``, shared with ``scripts/make_bench_data.py``); a path dataset reads its rows'
lengths (byte tokenizer: bytes of prompt + response, or of text, + bos + eos; or a ``num_tokens`` field).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from lorafusion.core.errors import UserError
from lorafusion.core.lengths import LENGTH_PROFILES, profile_lengths

from .spec import JobSpec

SPECIAL_TOKENS = 2  # bos + eos, added to every sample by the byte tokenizer's sample builder


class TraceError(UserError, ValueError):
    """A trace file or trace job is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class TraceJob:
    name: str
    arrival_s: float
    global_batch_size: int
    max_steps: int
    r: int = 16
    priority: int = 0
    profile: str | None = None
    path: str | None = None  # as written in the trace (relative to the trace file)
    seed: int | None = None

    def to_dict(self) -> dict:
        ds = {"profile": self.profile} if self.profile is not None else {"path": self.path}
        out = {"name": self.name, "arrival_s": self.arrival_s, "dataset": ds, "lora": {"r": self.r},
               "global_batch_size": self.global_batch_size, "max_steps": self.max_steps,
               "priority": self.priority}
        if self.seed is not None:
            out["seed"] = self.seed
        return out


@dataclass(frozen=True)
class Trace:
    jobs: tuple[TraceJob, ...]  # in arrival order (ties: file order)
    source: str = "<memory>"  # file the trace was read from; relative dataset paths resolve against it
    seed: int | None = None
    note: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def base_dir(self) -> Path:
        return Path(self.source).parent if self.source != "<memory>" else Path(".")

    def scaled(self, factor: float) -> Trace:
        """The same jobs with every arrival time multiplied by ``factor`` (a load sweep)."""
        return replace(self, jobs=tuple(replace(j, arrival_s=j.arrival_s * factor) for j in self.jobs))


_JOB_KEYS = {"name", "arrival_s", "dataset", "lora", "global_batch_size", "max_steps", "priority", "seed"}


def _int(where: str, v, lo: int | None = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise TraceError(f"{where}: expected an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
    return v


def parse_job(d, where: str) -> TraceJob:
    """One trace job from a mapping; ``where`` prefixes every error (``file: jobs[i]``)."""
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected a mapping of job fields, got {type(d).__name__}")
    unknown = sorted(set(d) - _JOB_KEYS)
    if unknown:
        raise TraceError(f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(sorted(_JOB_KEYS))})")
    for key in ("name", "arrival_s", "dataset", "global_batch_size", "max_steps"):
        if key not in d:
            raise TraceError(f"{where}.{key}: missing")
    name = d["name"]
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise TraceError(f"{where}.name: expected a non-empty name without spaces, got {name!r}")
    arr = d["arrival_s"]
    if isinstance(arr, bool) or not isinstance(arr, (int, float)) or not math.isfinite(arr) or arr < 0:
        raise TraceError(f"{where}.arrival_s: expected seconds >= 0, got {arr!r}")
    ds = d["dataset"]
    if not isinstance(ds, dict) or len(set(ds) & {"profile", "path"}) != 1 or set(ds) - {"profile", "path"}:
        raise TraceError(f"{where}.dataset: expected {{profile: NAME}} or {{path: FILE}}, got {ds!r}")
    profile, path = ds.get("profile"), ds.get("path")
    if profile is not None and profile not in LENGTH_PROFILES:
        raise TraceError(f"{where}.dataset.profile: expected one of {sorted(LENGTH_PROFILES)}, got "
                         f"{profile!r}")
    if path is not None and (not isinstance(path, str) or not path):
        raise TraceError(f"{where}.dataset.path: expected a file path, got {path!r}")
    lora = d.get("lora", {})
    if not isinstance(lora, dict) or set(lora) - {"r"}:
        raise TraceError(f"{where}.lora: expected {{r: RANK}}, got {lora!r}")
    return TraceJob(
        name=name, arrival_s=float(arr),
        global_batch_size=_int(f"{where}.global_batch_size", d["global_batch_size"]),
        max_steps=_int(f"{where}.max_steps", d["max_steps"]),
        r=_int(f"{where}.lora.r", lora.get("r", 16)),
        priority=_int(f"{where}.priority", d.get("priority", 0), lo=None),
        profile=profile, path=path,
        seed=None if d.get("seed") is None else _int(f"{where}.seed", d["seed"], lo=0),
    )


def parse_trace(data, source: str = "<memory>") -> Trace:
    """A trace from a parsed YAML document (mapping with ``jobs``) or a list of job mappings."""
    if isinstance(data, list):
        data = {"jobs": data}
    if not isinstance(data, dict) or "jobs" not in data:
        raise TraceError(f"{source}: jobs: missing (a trace is a mapping with a 'jobs' list)")
    extra = sorted(set(data) - {"jobs", "seed", "note", "meta"})
    if extra:
        raise TraceError(f"{source}: {extra[0]}: unknown top-level field (allowed: jobs, seed, note, meta)")
    raw = data["jobs"]
    if not isinstance(raw, list) or not raw:
        raise TraceError(f"{source}: jobs: expected a non-empty list of jobs")
    jobs = [parse_job(d, f"{source}: jobs[{i}]") for i, d in enumerate(raw)]
    seen: dict[str, int] = {}
    for i, j in enumerate(jobs):
        if j.name in seen:
            raise TraceError(f"{source}: jobs[{i}].name: {j.name!r} repeats jobs[{seen[j.name]}]")
        seen[j.name] = i
    seed = data.get("seed")
    if seed is not None:
        _int(f"{source}: seed", seed, lo=0)
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    return Trace(tuple(jobs[i] for i in order), source, seed, str(data.get("note", "")),
                 dict(data.get("meta") or {}))


def load_trace(path: str | Path) -> Trace:
    """Read a ``.yaml``/``.yml`` or ``.jsonl`` trace (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path}: line {n}: not JSON ({e.msg})") from None
        return parse_trace(rows, str(path))
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TraceError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_trace(data, str(path))


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace as YAML (``.yaml``) or JSONL (``.jsonl``)."""
    path = Path(path)
    jobs = [j.to_dict() for j in trace.jobs]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
        return
    import yaml

    doc = {k: v for k, v in (("seed", trace.seed), ("note", trace.note or None), ("meta", trace.meta or None))
           if v is not None}
    doc["jobs"] = jobs
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=110))


def _row_tokens(row, where: str) -> int:
    if isinstance(row, dict):
        if "num_tokens" in row:
            return _int(f"{where}.num_tokens", row["num_tokens"])
        if "prompt" in row and "response" in row:
            return len(str(row["prompt"]).encode()) + len(str(row["response"]).encode()) + SPECIAL_TOKENS
        if "text" in row:
            return len(str(row["text"]).encode()) + SPECIAL_TOKENS
    raise TraceError(f"{where}: expected a JSON object with prompt+response, text or num_tokens")


def dataset_lengths(job: TraceJob, base_dir: Path, n: int, trace_seed: int = 0) -> list[int]:
    """``n`` sample lengths in tokens: drawn from the job's profile, or its file's rows in order (cycled)."""
    if job.profile is not None:
        seed = job.seed if job.seed is not None else zlib.crc32(f"{trace_seed}:{job.name}".encode())
        return [int(x) + SPECIAL_TOKENS for x in profile_lengths(job.profile, n, np.random.default_rng(seed))]
    p = Path(job.path)
    p = p if p.is_absolute() else base_dir / p
    if not p.is_file():
        raise TraceError(f"job {job.name!r}: dataset.path: no such file {p}")
    lens = []
    for k, line in enumerate(p.read_text().splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{p}: line {k}: not JSON ({e.msg})") from None
            lens.append(_row_tokens(row, f"{p}: line {k}"))
    if not lens:
        raise TraceError(f"job {job.name!r}: dataset.path: {p} has no rows")
    return [lens[i % len(lens)] for i in range(n)]


def job_spec(job: TraceJob, base_dir: Path = Path("."), trace_seed: int = 0,
             truncate: bool = True) -> JobSpec:
    """The scheduler's view of a trace job: ``max_steps`` global batches of ``global_batch_size`` samples."""
    n, g = job.max_steps * job.global_batch_size, job.global_batch_size
    lens = dataset_lengths(job, base_dir, n, trace_seed)
    batches = [[(f"{job.name}:{k}", lens[k]) for k in range(s * g, (s + 1) * g)]
               for s in range(job.max_steps)]
    return JobSpec(job.name, batches, g, priority=job.priority, rank=job.r, truncate=truncate)


def trace_specs(trace: Trace) -> list[JobSpec]:
    return [job_spec(j, trace.base_dir, trace.seed or 0) for j in trace.jobs]


# Mix of the generator (stated in the benchmark's output): uniform over these choices.
GEN_PROFILES = ("short", "medium", "long", "mixed")
GEN_RANKS = (8, 16, 32, 64)
GEN_BATCH_SIZES = (8, 16, 32)
GEN_STEPS = (10, 25, 50, 100)


def poisson_trace(n_jobs: int = 12, seed: int = 0, rate_per_s: float = 1.0, prefix: str = "j") -> Trace:
    """``n_jobs`` jobs of mixed profile, rank, batch size and length, arriving by a Poisson process.

    The first job arrives at 0; gaps are exponential with mean ``1/rate_per_s``. Job attributes and
    the unit-rate gaps come from separate streams of ``seed``, so a different rate only rescales the
    arrival times (``Trace.scaled``) and keeps the jobs.
    """
    if n_jobs < 1 or rate_per_s <= 0:
        raise TraceError("poisson_trace: n_jobs must be >= 1 and rate_per_s > 0")
    jr, ar = (np.random.default_rng([seed, k]) for k in (0, 1))
    gaps = np.concatenate([[0.0], ar.exponential(1.0, n_jobs - 1)]) / rate_per_s
    arrivals = np.cumsum(gaps)
    jobs = []
    for i in range(n_jobs):
        jobs.append(TraceJob(
            name=f"{prefix}{i:02d}", arrival_s=round(float(arrivals[i]), 6),
            global_batch_size=int(jr.choice(GEN_BATCH_SIZES)), max_steps=int(jr.choice(GEN_STEPS)),
            r=int(jr.choice(GEN_RANKS)), profile=str(jr.choice(GEN_PROFILES)),
            seed=int(jr.integers(0, 2**31 - 1)),
        ))
    meta = {"generator": "poisson_trace", "n_jobs": n_jobs, "seed": seed, "rate_per_s": rate_per_s}
    return Trace(tuple(jobs), seed=seed, meta=meta)


def trace_dict(trace: Trace) -> dict:
    return {"source": trace.source, "seed": trace.seed, "meta": trace.meta,
            "jobs": [j.to_dict() for j in trace.jobs]}


__all__ = ["LENGTH_PROFILES", "Trace", "TraceError", "TraceJob", "dataset_lengths", "job_spec",
           "load_trace", "parse_trace", "poisson_trace", "profile_lengths", "save_trace", "trace_specs"]
