"""``scheduler.policy`` in real runs: shortest first (with fill of the idle pipeline slots) and fifo change only
when each job's batches run, never what a job learns."""

import json

import pytest
import yaml

from runtime_utils import assert_close, load_adapter, write_run
from test_distributed import _train_two_processes


def _with_policy(run, policy: str):
    doc = yaml.safe_load(run.read_text())
    doc["scheduler"]["policy"] = policy
    doc["scheduler"]["solver"] = "greedy"
    run.write_text(yaml.safe_dump(doc, sort_keys=False))
    return run


@pytest.mark.slow
def test_shortest_first_at_pp2_trains_every_adapter_as_together_does(three_jobs, tmp_path):
    """Two processes, pp=2, shortest first: the main job's idle slots are filled with the other jobs' batches
    (tests/runtime/test_feed.py shows the fill); per-step losses and final adapters equal the single-process
    run of all jobs together, so each equals training alone."""
    tmp, jobs, summary, out = three_jobs
    run = _with_policy(write_run(tmp_path, jobs, out="sf", pp=2), "shortest_first")
    _train_two_processes(run, guard=True)
    key = lambda r: (r["job"], r["step"])  # noqa: E731
    ours = sorted((json.loads(x) for x in (tmp_path / "sf" / "metrics.jsonl").read_text().splitlines()), key=key)
    ref = sorted((json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()), key=key)
    assert [key(r) for r in ours] == [key(r) for r in ref]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tokens"] == b["tokens"], (a, b)
    for job in ("rev", "up", "rev2"):
        assert_close(load_adapter(tmp_path / "sf", job), load_adapter(out, job), rel=1e-4)
    # the order of training: "up" (least work) finished first; its rows precede the others' last rows
    rows = [json.loads(x) for x in (tmp_path / "sf" / "metrics.jsonl").read_text().splitlines()]
    last = {r["job"]: i for i, r in enumerate(rows)}
    assert last["up"] < min(last["rev"], last["rev2"])
