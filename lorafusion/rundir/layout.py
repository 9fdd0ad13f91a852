"""The files of one run's output_dir (DESIGN.md §4), named once: :class:`RunDir`; and the readers of a job's
checkpoint pointers (``latest``, ``best``) and ``state.json``, which need no torch (``lorafusion export`` and
``generate`` look adapters up with them before loading anything)."""

from __future__ import annotations

import json
from pathlib import Path

from lorafusion.core.errors import MissingFileError


class RunDir:
    """A run's output directory: ``metrics.jsonl``, ``tensorboard/``, ``status.json``, ``summary.json``,
    ``requests/``, ``submitted/``, ``base_model.json``, ``run_config.json`` (the config each start ran with:
    what ``--resume`` continues, lorafusion.config.resume), ``checkpoints/<job>/step_NNNNNN``,
    ``adapters/<job>/``, ``.lock``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __fspath__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    lock = property(lambda self: self.root / ".lock")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    tensorboard = property(lambda self: self.root / "tensorboard")
    status = property(lambda self: self.root / "status.json")
    summary = property(lambda self: self.root / "summary.json")
    requests = property(lambda self: self.root / "requests")
    submitted = property(lambda self: self.root / "submitted")
    base_record = property(lambda self: self.root / "base_model.json")
    checkpoints = property(lambda self: self.root / "checkpoints")
    adapters = property(lambda self: self.root / "adapters")

    def job_checkpoints(self, job: str) -> Path:
        """``checkpoints/<job>``: the job's ``step_N`` directories and its ``latest`` / ``best`` pointers."""
        return self.checkpoints / job

    def adapter(self, job: str) -> Path:
        """``adapters/<job>``: the job's final PEFT adapter."""
        return self.adapters / job


def step_name(step: int) -> str:
    """The directory name of a job's checkpoint at ``step``."""
    return f"step_{step:06d}"


def _named_checkpoint(job_dir: Path, pointer_name: str) -> Path | None:
    """The checkpoint the pointer file ``job_dir/<pointer_name>`` names (None without the pointer)."""
    pointer = Path(job_dir) / pointer_name
    if not pointer.is_file():
        return None
    path = Path(job_dir) / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise MissingFileError(f"{pointer}: names {path.name}, which is not a complete checkpoint")
    return path


def best_checkpoint(job_dir: Path) -> Path | None:
    """The checkpoint ``job_dir/best`` names (None when the job has none)."""
    return _named_checkpoint(job_dir, "best")


def latest_checkpoint(job_dir: Path) -> Path | None:
    """The checkpoint ``job_dir/latest`` names (None when the job has none)."""
    return _named_checkpoint(job_dir, "latest")


def read_state(path: Path) -> dict:
    """A checkpoint's ``state.json``: a JSON object with at least ``job``, ``step`` and ``stream``, else a
    :class:`MissingFileError` naming the file."""
    file = Path(path) / "state.json"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MissingFileError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise MissingFileError(f"{file}: expected a JSON object, got {type(state).__name__}")
    missing = [k for k in ("job", "step", "stream") if k not in state]
    if missing:
        raise MissingFileError(f"{file}: no {', '.join(missing)} (expected a lorafusion checkpoint state)")
    if not isinstance(state["step"], int) or isinstance(state["step"], bool) or state["step"] < 0 \
            or not isinstance(state["stream"], dict):
        raise MissingFileError(f"{file}: step: expected an integer >= 0 and stream an object, got "
                               f"{state['step']!r} and {type(state['stream']).__name__}")
    return state
