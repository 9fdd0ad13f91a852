"""``OUTPUT_DIR/status.json``: where every job of a run stands, rewritten (atomically) by global rank 0 at each
chunk (as it starts) and at the end (:class:`lorafusion.runtime.telemetry.status.StatusWriter`);
``lorafusion status RUN_DIR [--json]`` reads it (here: torch-free, beside a busy run).

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
from pathlib import Path

from lorafusion.core.errors import MissingFileError
from lorafusion.rundir.layout import RunDir
from lorafusion.rundir.lock import lock_held


def read_status(run_dir: Path) -> dict:
    """The status of the run in ``run_dir`` (see the module doc); one clear error if there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MissingFileError(f"{run_dir}: no such run directory (the output_dir of a lorafusion train run)")
    path = RunDir(run_dir).status
    if not path.is_file():
        raise MissingFileError(f"{run_dir}: no {path.name} — not a lorafusion run directory, or its run has "
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
    lines.append(f"  {'job':<16} {'state':<9} {'step':>11} {'tokens':>12} {'last loss':>10} {'tokens/s':>10} {'ETA':>8}")
    for name, j in status["jobs"].items():
        loss = "-" if j.get("last_loss") is None else f"{j['last_loss']:.4f}"
        eta = "-" if j.get("eta_s") is None else _duration(j["eta_s"])
        lines.append(f"  {name:<16} {j['state']:<9} {j['step']:>5}/{j['max_steps']:<5} {j['tokens']:>12,} {loss:>10} "
                     f"{j['tokens_per_s']:>10,.0f} {eta:>8}")
    return "\n".join(lines)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
