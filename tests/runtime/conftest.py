"""Shared by the runtime tests: one trained three-job run (session-scoped: several files compare to it), and
one launch of two processes for every two-process run the selected tests ask for."""

import json
import os
import sys
from pathlib import Path

import pytest

from runtime_utils import three_job_dicts, train_inprocess, write_run
from session_shared import launch_in_turn, shared_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def three_jobs(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("rt")
    jobs = three_job_dicts(tmp)
    summary, out = train_inprocess(write_run(tmp, jobs, out="together"))
    return tmp, jobs, summary, out


@pytest.fixture(scope="session")
def two_process(request, tmp_path_factory):
    """``lorafusion train`` on two processes (RANK/WORLD_SIZE env, gloo) for every run that a selected test
    names with ``@pytest.mark.two_process(NAME, jobs=FN, guard=False, **write_run_kwargs)``: ``FN(dir)``
    writes the jobs' data and returns the job dicts. All those runs share one launch
    (tests/runtime/train_many.py: both ranks train them one after another, each through the CLI; a run that
    fails ends it, and the runs after it get a new launch), once per session for all xdist workers
    (tests/session_shared.py). Returns ``out(NAME)``: that run's output directory, once both ranks finished
    it."""
    runs = {}
    for item in request.session.items:
        for m in item.iter_markers("two_process"):
            runs.setdefault(m.args[0], m.kwargs)

    def launch(tmp: Path) -> None:
        spec = []
        for name, kw in runs.items():
            kw = dict(kw)
            jobs, guard = kw.pop("jobs"), kw.pop("guard", False)
            run = write_run(tmp / name, jobs(tmp / name), out="out", **kw)
            spec.append({"name": name, "run": str(run), "guard": guard})
        (tmp / "spec.json").write_text(json.dumps(spec, indent=1))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        launch_in_turn(
            [sys.executable, str(Path(__file__).with_name("train_many.py")), str(tmp / "spec.json")],
                       [s["name"] for s in spec], tmp, cwd=ROOT, env=env)

    tmp = shared_dir(tmp_path_factory, "two_process", launch)
    logs = [(tmp / f"rank{rank}.log").read_text() for rank in range(2)]

    def out(name: str) -> Path:
        if not all(f"=== {name} done\n" in log for log in logs):
            why = "\n".join(f"--- rank {r}:\n{_section(log, name)[-3000:]}" for r, log in enumerate(logs))
            pytest.fail(f"two-process run {name} did not finish on both ranks:\n{why}")
        return tmp / name / "out"

    return out


def _section(log: str, name: str) -> str:
    """What a rank printed for run ``name``, up to its last line (``=== NAME done``, ``failed`` or
    ``not done``)."""
    rest = log.partition(f"=== {name}\n")[2]
    last = rest.find("\n=== ")
    if last < 0:
        return rest
    end = rest.find("\n", last + 1)
    return rest if end < 0 else rest[:end]
