"""``OUTPUT_DIR/status.json``: where every job of a run stands, rewritten (atomically) by global rank 0 at
each chunk (as it starts) and at the end (:class:`lorafusion.runtime.telemetry.status.StatusWriter`);
``lorafusion status RUN_DIR [--json]`` reads it (here: torch-free, beside a busy run).

Per job: ``state`` (submitted — requested with ``lorafusion submit``, not taken by the run yet (a stopped run
takes it when resumed) | queued | running | waiting | cancelling | saving | done | cancelled | stopped |
diverged | early_stopped; ``waiting``: admitted and unfinished, but the chunk now running has none of its
batches — under ``scheduler.policy`` shortest_first or fifo, other jobs go first; ``saving``: its last step
ran and its final checkpoint and adapter are being written in the background — ``done`` once they are),
``step`` / ``max_steps``, ``tokens``, ``last_loss``, (jobs with an eval set) ``eval_loss``,
``best_eval_loss``, ``best_step``, ``tokens_per_s`` (this session's tokens of the job over the session's wall
time) and ``eta_s`` (its remaining steps at its rate this session). The run: ``state`` (starting | running |
serving | done | stopped), ``elapsed_s``, ``tokens_per_s``, ``updated`` (UTC). A run whose status says running
but whose output-dir lock nobody holds has ended without writing its end (killed): the reader reports it as
``stopped``.
"""

from __future__ import annotations

from pathlib import Path

from lorafusion.core.errors import MissingFileError
from lorafusion.rundir.jsonfile import read_json_file
from lorafusion.rundir.layout import RunDir
from lorafusion.rundir.lock import lock_held
from lorafusion.rundir.states import LIVE, JobStatus
from lorafusion.rundir.requests import queued_requests, unapplied_requests


def read_status(run_dir: Path) -> dict:
    """The status of the run in ``run_dir`` (see the module doc); one clear error if there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MissingFileError(f"{run_dir}: "
                               f"{'not a directory' if run_dir.exists() else 'no such run directory'} "
                               "(expected the output_dir of a lorafusion train run)")
    path = RunDir(run_dir).status
    if not path.exists():
        raise MissingFileError(f"{run_dir}: no {path.name} — not a lorafusion run directory, or its run has "
                               f"not finished its first chunk yet")
    try:
        status = read_json_file(path, nonfinite_as_none=True)  # (an Infinity: unknown)
        _check_shape(status)
    except OSError as e:
        raise MissingFileError(f"{path}: cannot read ({e.strerror or e})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise MissingFileError(f"{path}: not a readable run status "
                               f"({e.args[0] if isinstance(e, KeyError) and e.args else e})") from None
    if refused := unapplied_requests(run_dir):
        status["requests"] = refused
    _add_queued_requests(status, run_dir)
    if status["run"].get("state") in ("starting", "running", "serving") and not lock_held(run_dir):
        status["run"]["state"] = "stopped"  # killed: nobody holds the lock and the end was never written
        status["run"]["note"] = "no process holds the run's lock: it ended without writing its end (killed?)"
        for row in status["jobs"].values():
            if row.get("state") in LIVE:
                row["state"], row["eta_s"] = JobStatus.STOPPED.value, None
    return status


def _add_queued_requests(status: dict, run_dir: Path) -> None:
    """Requests the run has not taken yet (it takes them at a chunk boundary, a stopped run when resumed): a
    submitted job is listed as ``submitted`` (step 0), a job with a cancel queued is marked
    ``cancel_requested``."""
    for req in queued_requests(run_dir):
        if req["kind"] == "submit" and isinstance(req.get("name"), str) and req["name"] not in status["jobs"]:
            job = req.get("job") if isinstance(req.get("job"), dict) else {}
            steps = job.get("max_steps")
            status["jobs"][req["name"]] = {
                "state": "submitted", "step": 0, "max_steps": steps if isinstance(steps, int) else None,
                "tokens": 0, "tokens_per_s": 0.0, "last_loss": None, "eta_s": None}
        elif req["kind"] == "cancel" and isinstance(row := status["jobs"].get(req.get("job")), dict):
            row["cancel_requested"] = True


_RUN_FIELDS = {"state": str, "elapsed_s": (int, float), "tokens_per_s": (int, float), "updated": str}
_JOB_FIELDS = {"state": str, "step": int, "max_steps": int, "tokens": int, "tokens_per_s": (int, float),
               "last_loss": (int, float, type(None)), "eta_s": (int, float, type(None))}
_OPTIONAL = {"eval_loss": (int, float, type(None)), "best_eval_loss": (int, float, type(None)),
             "best_step": (int, type(None)), "note": str}


def _check_shape(status) -> None:
    """ValueError naming the first field of ``status`` that is missing or of the wrong type."""
    def check(row, fields, where):
        if not isinstance(row, dict):
            raise ValueError(f"{where.rstrip('.') or '(top level)'}: expected an object, got "
                             f"{type(row).__name__}")
        for key, kind in fields.items():
            if key not in row or not isinstance(row[key], kind) or isinstance(row[key], bool):
                raise ValueError(f"{where}{key}: missing or of the wrong type ({row.get(key)!r:.40})")
        for key, kind in _OPTIONAL.items():
            if key in row and (not isinstance(row[key], kind) or isinstance(row[key], bool)):
                raise ValueError(f"{where}{key}: of the wrong type ({row[key]!r:.40})")

    check(status, {"run": dict, "jobs": dict}, "")
    check(status["run"], _RUN_FIELDS, "run.")
    for name, row in status["jobs"].items():
        check(row, _JOB_FIELDS, f"jobs.{name}.")


def format_status(status: dict, run_dir: Path) -> str:
    """A table for people: one line per job."""
    run = status["run"]
    lines = [f"{run_dir}: {run['state']}, {run['elapsed_s']:.0f}s this session, {run['tokens_per_s']:,.0f} "
             f"tokens/s (updated {run['updated']})" + (f" — {run['note']}" if run.get("note") else "")]
    lines.append(f"  {'job':<16} {'state':<9} {'step':>11} {'tokens':>12} {'last loss':>10} "
                 f"{'eval loss':>10} {'best (step)':>16} {'tokens/s':>10} {'ETA':>8}")
    num = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for name, j in status["jobs"].items():
        eta = "-" if j.get("eta_s") is None else _duration(j["eta_s"])
        best = "-" if j.get("best_eval_loss") is None else f"{j['best_eval_loss']:.4f} ({j.get('best_step')})"
        state = j["state"] + (" (cancel queued)" if j.get("cancel_requested") else "")
        lines.append(f"  {name:<16} {state:<9} {j['step']:>5}/{j['max_steps'] or '-':<5} {j['tokens']:>12,} "
                     f"{num(j.get('last_loss')):>10} {num(j.get('eval_loss')):>10} {best:>16} "
                     f"{j['tokens_per_s']:>10,.0f} {eta:>8}")
    for r in status.get("requests", []):  # what the run refused: the user's submit said "submitted"
        lines.append(f"  request {r['file']} ({r['kind']} {r['job'] or '?'}): {r['answer'].splitlines()[0]}")
    return "\n".join(lines)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
