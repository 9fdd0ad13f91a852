"""``scheduler.policy`` in real runs: shortest first (with fill of the idle pipeline slots) changes only when
each job's batches run, never what a job learns."""

import json

import pytest
import yaml

from runtime_utils import assert_close, load_adapter, three_job_dicts


@pytest.mark.slow
@pytest.mark.two_process("pp2_shortest_first", jobs=three_job_dicts, guard=True, pp=2,
                         policy="shortest_first")
def test_shortest_first_at_pp2_trains_every_adapter_as_together_does(three_jobs, two_process):
    """Two processes, pp=2, shortest first: the main job's idle slots are filled with the other jobs' batches
    (tests/runtime/test_feed.py shows the fill); per-step losses and final adapters equal the single-process
    run of all jobs together, so each equals training alone."""
    tmp, jobs, summary, out = three_jobs
    sf = two_process("pp2_shortest_first")
    assert yaml.safe_load((sf.parent / "run.yaml").read_text())["scheduler"]["policy"] == "shortest_first"
    key = lambda r: (r["job"], r["step"])  # noqa: E731
    rows = [json.loads(x) for x in (sf / "metrics.jsonl").read_text().splitlines()]
    ours = sorted(rows, key=key)
    ref = sorted((json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()), key=key)
    assert [key(r) for r in ours] == [key(r) for r in ref]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tokens"] == b["tokens"], (a, b)
    for job in ("rev", "up", "rev2"):
        assert_close(load_adapter(sf, job), load_adapter(out, job), rel=1e-4)
    # the order of training: "up" (least work) finished first; its rows precede the others' last rows
    last = {r["job"]: i for i, r in enumerate(rows)}
    assert last["up"] < min(last["rev"], last["rev2"])
