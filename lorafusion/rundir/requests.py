"""Requests to a run (``lorafusion submit`` / ``cancel``): files in ``RUN_DIR/requests/``, taken by the run at
a chunk boundary (or when it starts, for a stopped run resumed later).

A request is one JSON file written atomically (``submit``: the validated job, its paths absolute; ``cancel``:
the job's name), named so that a directory listing is the order of arrival. Global rank 0 takes them and moves
each to ``requests/done/`` (with the run's answer) once applied; every rank receives the same list by
broadcast.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.jsonfile import read_json_file
from lorafusion.rundir.layout import RunDir
# after these a cancel has nothing to do (the run: LiveJobs._cancel)
from lorafusion.rundir.states import ENDED, JobStatus



def require_run_dir(run_dir: Path) -> None:
    """One clear error unless ``run_dir`` is the output_dir of a run that has started."""
    if not (Path(run_dir).is_dir() and any((Path(run_dir) / n).exists()
                                           for n in ("status.json", "summary.json", "checkpoints", ".lock"))):
        raise MissingFileError(f"{run_dir}: not a lorafusion run directory (the output_dir of a lorafusion "
                               f"train run that has started)")


def write_request(run_dir: Path, kind: str, payload: dict) -> Path:
    """Queue one request for the run in ``run_dir``; returns its file."""
    run_dir = Path(run_dir)
    require_run_dir(run_dir)
    d = RunDir(run_dir).requests
    d.mkdir(exist_ok=True)
    stamp = f"{time.time_ns():020d}"
    path = d / f"{stamp}-{kind}-{payload.get('name', payload.get('job', ''))}.json"
    write_text_atomic(path, json.dumps({"kind": kind, **payload}, indent=2) + "\n")
    return path


def _listed(run_dir: Path) -> list[tuple[Path, dict | Exception]]:
    """Every request file in arrival order, with its request or why it cannot be read."""
    d = RunDir(run_dir).requests
    out: list[tuple[Path, dict | Exception]] = []
    for path in sorted(p for p in d.glob("*.json") if not p.name.startswith(".")) if d.is_dir() else []:
        try:  # (a regular file only, never blocking on a FIFO; bounded in size and depth; UTF-8)
            req = read_json_file(path)
        except FileNotFoundError:  # taken by the run while the CLI was looking
            continue
        except (OSError, ValueError) as e:
            out.append((path, ValueError(e.strerror if isinstance(e, OSError) and e.strerror else str(e))))
            continue
        if not isinstance(req, dict) or req.get("kind") not in ("submit", "cancel"):
            kind = req.get("kind") if isinstance(req, dict) else f"a JSON {type(req).__name__}, not an object"
            out.append((path, ValueError(f"unknown kind {kind!r:.80}")))
        else:
            out.append((path, req))
    return out


def pending_requests(run_dir: Path) -> list[tuple[Path, dict]]:
    """The queued requests in arrival order (unreadable files are answered with an error and set aside)."""
    out = []
    for path, req in _listed(run_dir):
        if isinstance(req, Exception):
            answer_request(path, {"kind": "?"}, f"refused: unreadable request ({req})")
        else:
            out.append((path, req))
    return out


def queued_requests(run_dir: Path) -> list[dict]:
    """The readable requests the run has not taken yet, in arrival order (only read: the run answers them)."""
    return [req for _, req in _listed(run_dir) if isinstance(req, dict)]


def answer_request(path: Path, req: dict, answer: str) -> None:
    """Move a taken request to ``requests/done/`` with the run's answer."""
    done = path.parent / "done"
    done.mkdir(exist_ok=True)
    write_text_atomic(done / path.name, json.dumps({**req, "answer": answer}, indent=2) + "\n")
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:  # (a directory named like a request: moved aside whole, never read again)
        os.replace(path, done / f"{path.name}.not-a-file-{time.time_ns()}")


def unapplied_requests(run_dir: Path) -> list[dict]:
    """Requests the run refused or could not apply (in ``requests/done/``), oldest first: ``file``, ``kind``,
    ``job`` and the run's ``answer`` (``lorafusion status`` shows them)."""
    d = RunDir(run_dir).requests / "done"
    out = []
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            req = read_json_file(path)
        except (OSError, ValueError):
            continue
        answer = req.get("answer") if isinstance(req, dict) else None
        if isinstance(answer, str) and answer.startswith(("refused", "failed")):
            job = req.get("name", req.get("job"))
            out.append(
                {"file": path.name, "kind": str(req.get("kind")),
                 "job": job if isinstance(job, str) else None, "answer": answer})
    return out


def _status_jobs(run_dir: Path) -> dict:
    """``status.json``'s rows by job ({} when the run has written none, or none readable yet)."""
    try:
        jobs = read_json_file(RunDir(run_dir).status).get("jobs", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return jobs if isinstance(jobs, dict) else {}


def known_job_names(run_dir: Path, status_jobs: dict | None = None) -> set[str]:
    """Jobs the run has or will have: in its status (``status_jobs``, read when not given), and in submissions
    not yet taken."""
    names = set(_status_jobs(run_dir) if status_jobs is None else status_jobs)
    # (the CLI only looks: the run takes the requests and answers unreadable ones)
    names |= {r.get("name") for _, r in _listed(run_dir) if isinstance(r, dict) and r["kind"] == "submit"
              and isinstance(r.get("name"), str)}
    return names


def check_cancel(run_dir: Path, job_name: str) -> None:
    """A cancel names a job of the run that has not ended (as ``status.json`` says; the run answers the
    rest)."""
    rows = _status_jobs(run_dir)
    names = known_job_names(run_dir, rows)
    if job_name not in names:
        try:  # (a status.json that cannot be read is named, not taken for a run without jobs)
            read_json_file(RunDir(run_dir).status) if RunDir(run_dir).status.exists() else None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{RunDir(run_dir).status}: not readable ({e}); the run's jobs are not "
                              "known") from None
        raise ConfigError(f"{run_dir}: --job: no job {job_name!r} in this run (jobs: "
                          f"{', '.join(sorted(names)) or 'none'})")
    row = rows.get(job_name)
    state = row.get("state") if isinstance(row, dict) else None  # (None: only submitted so far)
    if state in ENDED:
        raise ConfigError(f"{run_dir}: --job: job {job_name!r} is already {state}: nothing to cancel")
    if state == JobStatus.CANCELLING:
        raise ConfigError(f"{run_dir}: --job: job {job_name!r} is already being cancelled: it leaves once "
                          f"its planned batches have run (lorafusion status {run_dir})")
    queued = [p.name for p, r in _listed(run_dir) if isinstance(r, dict) and r["kind"] == "cancel"
              and r.get("job") == job_name]
    if queued:
        raise ConfigError(f"{run_dir}: --job: a cancel of job {job_name!r} is already queued "
                          f"(requests/{queued[0]}): it leaves at the next chunk boundary")


def check_against_run(run_dir: Path, job) -> None:
    """What ``submit`` checks before it answers, against the run's record (``base_model.json``: its model and
    tokenizer) and limits (``status.json``'s ``run.limits``), as the run checks it at the boundary: the job's
    ``dataset.max_seq_len`` within the token capacity, its adapter's memory, its data read and tokenized
    (every sample valid and within max_seq_len; the eval share too). A run that has written neither yet
    (starting, or written before the limits were recorded) checks it itself."""
    from lorafusion.core.arch import arch_from_hf_config
    from lorafusion.core.lora import check_adapter_memory

    rd = RunDir(run_dir)
    try:
        record = read_json_file(rd.base_record)
        limits = read_json_file(rd.status)["run"]["limits"]
        cap, memory, mp = int(limits["token_capacity"]), limits["memory_bytes"], limits["model_parallel"]
        arch = arch_from_hf_config(record["config"], str(rd.base_record))
    except (OSError, ValueError, KeyError, TypeError):  # (a capacity of None: not recorded)
        return
    if job.dataset.max_seq_len > cap:
        raise ConfigError(f"job {job.name!r}: dataset.max_seq_len {job.dataset.max_seq_len} exceeds the "
                          f"run's scheduler.token_capacity {cap} ({run_dir})")
    check_adapter_memory(job.name, job.lora, arch, cap, memory, mp)
    from lorafusion.config.schema import TokenizerConfig
    from lorafusion.data import JobStream
    from lorafusion.data.dataset import load_job_samples
    from lorafusion.data.evalset import split_job_samples
    from lorafusion.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(**record["tokenizer"]), record.get("path"))
    samples, _ = split_job_samples(job, load_job_samples(job, tokenizer).samples, tokenizer, record["seed"])
    # as the run builds it: batch size vs samples, warmup vs steps
    JobStream.of(job, len(samples), record["seed"])


def check_submission(run_dir: Path, job_name: str) -> None:
    if job_name in known_job_names(run_dir):
        raise ConfigError(f"{run_dir}: a job named {job_name!r} is already in this run (or submitted); "
                          f"choose another name")
