"""Rank 0's writer of ``OUTPUT_DIR/status.json`` (the format: :mod:`lorafusion.rundir.status`, which reads
it)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.layout import RunDir
from lorafusion.rundir.states import JobStatus


class StatusWriter:
    """Rank 0's writer. ``jobs``: name → JobState (``steps``, ``tokens``, ``last_loss``, ``status``,
    ``stream.total_steps``); a job's counts when first seen are its start in this session (a resumed run, a
    job that joined later), from which its tokens/s and ETA are taken."""

    def __init__(self, out: Path, jobs: dict, limits: dict | None = None):
        self.path = RunDir(out).status
        self.jobs = jobs
        self.limits = limits  # what `lorafusion submit` checks a job against (runtime.admission.run_limits)
        self._t0 = time.perf_counter()
        self._start: dict[str, tuple[int, int, float]] = {}  # job -> (steps, tokens, time) when first seen
        self.write("starting")

    def write(self, run_state: str = "running", job_states: dict[str, str] | None = None,
              in_chunk: set[str] | None = None) -> dict:
        """``in_chunk``: the jobs the chunk now starting holds (the other running ones are waiting)."""
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._t0)
        rows, session_tokens = {}, 0
        for n, js in self.jobs.items():
            # a job may join later
            steps0, tokens0, t_join = self._start.setdefault(n, (js.steps, js.tokens, now))
            job_elapsed = max(1e-9, now - t_join)
            done_steps, done_tokens = js.steps - steps0, js.tokens - tokens0
            session_tokens += done_tokens
            total = js.stream.total_steps
            state = (job_states or {}).get(n) or (
                js.shown(run_stopped=run_state == "stopped",
                         in_chunk=None if in_chunk is None else n in in_chunk))
            remaining = max(0, total - js.steps)
            eta = (remaining * job_elapsed / done_steps) if done_steps and state == JobStatus.RUNNING else (
                0.0 if state == JobStatus.DONE else None)
            rows[n] = {"state": state, "step": js.steps, "max_steps": total, "tokens": js.tokens,
                       "last_loss": js.last_loss, "tokens_per_s": round(done_tokens / job_elapsed, 1),
                       "eta_s": None if eta is None else round(eta, 1), **eval_fields(js)}
        status = {"run": {"state": run_state, "elapsed_s": round(elapsed, 3),
                          "tokens_per_s": round(session_tokens / elapsed, 1),
                          "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          **({"limits": self.limits} if self.limits else {})},
                  "jobs": rows}
        write_text_atomic(self.path, json.dumps(status, indent=2) + "\n")
        return status


def eval_fields(js) -> dict:
    """A job with an eval set: its last and best eval loss and the best's step."""
    if getattr(js, "eval_samples", None) is None:
        return {}
    return {"eval_loss": js.last_eval, "best_eval_loss": js.best_eval, "best_step": js.best_step}
