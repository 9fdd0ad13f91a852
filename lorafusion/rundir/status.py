"""``OUTPUT_DIR/status.json``: where every job of a run stands, rewritten (atomically) by global rank 0 at each
chunk (as it starts) and at the end; ``lorafusion status RUN_DIR [--json]`` reads it.

Per job: ``state`` (queued | running | waiting | cancelling | saving | done | cancelled | stopped | diverged |
early_stopped; ``waiting``: admitted and unfinished, but the chunk now running has none of its batches — under
``scheduler.policy`` shortest_first or fifo, other jobs go first; ``saving``: its last step ran and its final
checkpoint and adapter are being written in the background — ``done`` once they are), ``step`` / ``max_steps``, ``tokens``, ``last_loss``, (jobs with an eval set) ``eval_loss``,
``best_eval_loss``, ``best_step``,
``tokens_per_s`` (this session's tokens of the job over the session's wall time) and ``eta_s`` (its remaining
steps at its rate this session). The run: ``state`` (starting | running | serving | done | stopped), ``elapsed_s``, ``tokens_per_s``,
``updated`` (UTC). A run whose status says running but whose output-dir lock nobody holds has ended without
writing its end (killed): the reader reports it as ``stopped``.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

from lorafusion.core.errors import MissingFileError
from lorafusion.rundir.lock import lock_held

STATUS_FILE = "status.json"


class StatusWriter:
    """Rank 0's writer. ``jobs``: name → JobState (``steps``, ``tokens``, ``last_loss``, ``status``,
    ``stream.total_steps``); a job's counts when first seen are its start in this session (a resumed run, a
    job that joined later), from which its tokens/s and ETA are taken."""

    def __init__(self, out: Path, jobs: dict):
        self.path = Path(out) / STATUS_FILE
        self.jobs = jobs
        self._t0 = time.perf_counter()
        self._start: dict[str, tuple[int, int, float]] = {}  # job -> (steps, tokens, time) when first seen
        self.write("starting")

    def write(self, run_state: str = "running", job_states: dict[str, str] | None = None,
              in_chunk: set[str] | None = None) -> dict:
        """``in_chunk``: the jobs the chunk now starting holds (the other running ones are waiting)."""
        from lorafusion.rundir.lock import write_text_atomic

        now = time.perf_counter()
        elapsed = max(1e-9, now - self._t0)
        rows, session_tokens = {}, 0
        for n, js in self.jobs.items():
            steps0, tokens0, t_join = self._start.setdefault(n, (js.steps, js.tokens, now))  # a job may join later
            job_elapsed = max(1e-9, now - t_join)
            done_steps, done_tokens = js.steps - steps0, js.tokens - tokens0
            session_tokens += done_tokens
            total = js.stream.total_steps
            state = (job_states or {}).get(n) or (
                js.status if js.status != "running" else
                "done" if js.written else  # its final checkpoint and adapter are written
                "saving" if js.handed_over else
                "running" if js.steps >= total else
                "stopped" if run_state == "stopped" else
                "waiting" if in_chunk is not None and n not in in_chunk else "running")
            remaining = max(0, total - js.steps)
            eta = (remaining * job_elapsed / done_steps) if done_steps and state == "running" else (
                0.0 if state == "done" else None)
            rows[n] = {"state": state, "step": js.steps, "max_steps": total, "tokens": js.tokens,
                       "last_loss": js.last_loss, "tokens_per_s": round(done_tokens / job_elapsed, 1),
                       "eta_s": None if eta is None else round(eta, 1), **eval_fields(js)}
        status = {"run": {"state": run_state, "elapsed_s": round(elapsed, 3),
                          "tokens_per_s": round(session_tokens / elapsed, 1),
                          "updated": datetime.now(timezone.utc).isoformat(timespec="seconds")},
                  "jobs": rows}
        write_text_atomic(self.path, json.dumps(status, indent=2) + "\n")
        return status


def eval_fields(js) -> dict:
    """A job with an eval set: its last and best eval loss and the best's step."""
    if getattr(js, "eval_samples", None) is None:
        return {}
    return {"eval_loss": js.last_eval, "best_eval_loss": js.best_eval, "best_step": js.best_step}


def read_status(run_dir: Path) -> dict:
    """The status of the run in ``run_dir`` (see the module doc); one clear error if there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MissingFileError(f"{run_dir}: no such run directory (the output_dir of a lorafusion train run)")
    path = run_dir / STATUS_FILE
    if not path.is_file():
        raise MissingFileError(f"{run_dir}: no {STATUS_FILE} — not a lorafusion run directory, or its run has "
                               f"not finished its first chunk yet")
    try:
        status = json.loads(path.read_text())
        status["run"], status["jobs"]  # noqa: B018 - the two keys every reader needs
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise MissingFileError(f"{path}: not a readable run status ({e})") from None
    if status["run"].get("state") in ("starting", "running", "serving") and not lock_held(run_dir):
        status["run"]["state"] = "stopped"  # killed: nobody holds the lock and the end was never written
        status["run"]["note"] = "no process holds the run's lock: it ended without writing its end (killed?)"
        for row in status["jobs"].values():
            if row.get("state") in ("running", "waiting", "cancelling", "saving"):
                row["state"], row["eta_s"] = "stopped", None
    return status


def format_status(status: dict, run_dir: Path) -> str:
    """A table for people: one line per job."""
    run = status["run"]
    lines = [f"{run_dir}: {run['state']}, {run['elapsed_s']:.0f}s this session, {run['tokens_per_s']:,.0f} tokens/s "
             f"(updated {run['updated']})" + (f" — {run['note']}" if run.get("note") else "")]
    lines.append(f"  {'job':<16} {'state':<9} {'step':>11} {'tokens':>12} {'last loss':>10} {'eval loss':>10} "
                 f"{'best (step)':>16} {'tokens/s':>10} {'ETA':>8}")
    num = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for name, j in status["jobs"].items():
        eta = "-" if j.get("eta_s") is None else _duration(j["eta_s"])
        best = "-" if j.get("best_eval_loss") is None else f"{j['best_eval_loss']:.4f} ({j.get('best_step')})"
        lines.append(f"  {name:<16} {j['state']:<9} {j['step']:>5}/{j['max_steps']:<5} {j['tokens']:>12,} "
                     f"{num(j.get('last_loss')):>10} {num(j.get('eval_loss')):>10} {best:>16} "
                     f"{j['tokens_per_s']:>10,.0f} {eta:>8}")
    return "\n".join(lines)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
