"""Requests to a run (``lorafusion submit`` / ``cancel``): files in ``RUN_DIR/requests/``, taken by the run at a
chunk boundary (or when it starts, for a stopped run resumed later).

A request is one JSON file written atomically (``submit``: the validated job, its paths absolute; ``cancel``: the
job's name), named so that a directory listing is the order of arrival. Global rank 0 takes them and moves each
to ``requests/done/`` (with the run's answer) once applied; every rank receives the same list by broadcast.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lorafusion.core.errors import ConfigError, MissingFileError

REQUESTS = "requests"


def require_run_dir(run_dir: Path) -> None:
    """One clear error unless ``run_dir`` is the output_dir of a run that has started."""
    if not (Path(run_dir).is_dir() and any((Path(run_dir) / n).exists()
                                           for n in ("status.json", "summary.json", "checkpoints", ".lock"))):
        raise MissingFileError(f"{run_dir}: not a lorafusion run directory (the output_dir of a lorafusion train "
                               f"run that has started)")


def write_request(run_dir: Path, kind: str, payload: dict) -> Path:
    """Queue one request for the run in ``run_dir``; returns its file."""
    run_dir = Path(run_dir)
    require_run_dir(run_dir)
    d = run_dir / REQUESTS
    d.mkdir(exist_ok=True)
    stamp = f"{time.time_ns():020d}"
    path = d / f"{stamp}-{kind}-{payload.get('name', payload.get('job', ''))}.json"
    tmp = d / f".{path.name}.tmp"
    tmp.write_text(json.dumps({"kind": kind, **payload}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def pending_requests(run_dir: Path) -> list[tuple[Path, dict]]:
    """The queued requests in arrival order (unreadable files are answered with an error and set aside)."""
    d = Path(run_dir) / REQUESTS
    if not d.is_dir():
        return []
    out = []
    for path in sorted(p for p in d.glob("*.json") if not p.name.startswith(".")):
        try:
            req = json.loads(path.read_text())
            if req.get("kind") not in ("submit", "cancel"):
                raise ValueError(f"unknown kind {req.get('kind')!r}")
        except (ValueError, UnicodeDecodeError) as e:
            answer_request(path, {"kind": "?"}, f"refused: unreadable request ({e})")
            continue
        out.append((path, req))
    return out


def answer_request(path: Path, req: dict, answer: str) -> None:
    """Move a taken request to ``requests/done/`` with the run's answer."""
    done = path.parent / "done"
    done.mkdir(exist_ok=True)
    tmp = done / f".{path.name}.tmp"
    tmp.write_text(json.dumps({**req, "answer": answer}, indent=2) + "\n")
    os.replace(tmp, done / path.name)
    path.unlink(missing_ok=True)


def known_job_names(run_dir: Path) -> set[str]:
    """Jobs the run has or will have: in its status, and in submissions not yet taken."""
    names: set[str] = set()
    status = Path(run_dir) / "status.json"
    if status.is_file():
        try:
            names |= set(json.loads(status.read_text()).get("jobs", {}))
        except (ValueError, UnicodeDecodeError):
            pass
    names |= {r.get("name") for _, r in pending_requests_peek(run_dir) if r.get("kind") == "submit"}
    return names


def pending_requests_peek(run_dir: Path) -> list[tuple[Path, dict]]:
    """Like :func:`pending_requests` but never moves a file (for the CLI, which is not the run)."""
    d = Path(run_dir) / REQUESTS
    out = []
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            out.append((path, json.loads(path.read_text())))
        except (ValueError, UnicodeDecodeError, OSError):
            continue
    return out


def check_submission(run_dir: Path, job_name: str) -> None:
    if job_name in known_job_names(run_dir):
        raise ConfigError(f"{run_dir}: a job named {job_name!r} is already in this run (or submitted); "
                          f"choose another name")
