"""Two processes (PP=2, DP=2, TP=2, TP=2 with sequence parallelism, PP=2 with recompute) train exactly like
one.

The two-process runs come from the shared launch (fixture ``two_process``, tests/runtime/conftest.py): both
ranks of ``lorafusion train`` run each YAML through the CLI, one run after another in one process pair."""

import json
from pathlib import Path

import pytest

from runtime_utils import (assert_close, job_dict, load_adapter, three_job_dicts, train_inprocess,
                           write_dataset, write_run)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["job"], r["step"]))


def _whole_batch_jobs(tmp: Path) -> list[dict]:
    return [job_dict("a", write_dataset(tmp / "d" / "a.jsonl", 1), r=4, steps=5, gbs=8),
            job_dict("b", write_dataset(tmp / "d" / "b.jsonl", 2, kind="upper"), r=8, steps=5, gbs=1),
            job_dict("c", write_dataset(tmp / "d" / "c.jsonl", 3), r=4, steps=4, gbs=3)]


@pytest.mark.slow
@pytest.mark.two_process("dp2_whole_batches", jobs=_whole_batch_jobs, dp=2, capacity=1024)
def test_dp2_with_whole_global_batches_in_one_microbatch_equals_dp1(tmp_path, megatron_single, two_process):
    """The quickstart shape at dp=2: a large token capacity (a global batch fits one microbatch) and a job
    of one sample per step (which one DP rank alone can hold). Both ranks step every job in lockstep
    (the one without a microbatch of it reduces zero gradients) and the result equals dp=1 per step."""
    _, ref = train_inprocess(write_run(tmp_path, _whole_batch_jobs(tmp_path), out="dp1", capacity=1024,
                                       name="dp1.yaml"))
    dp2 = two_process("dp2_whole_batches")
    ours, theirs = _metrics(dp2), _metrics(ref)
    assert [(r["job"], r["step"]) for r in ours] == [(r["job"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    for job in ("a", "b", "c"):
        assert_close(load_adapter(dp2, job), load_adapter(ref, job), rel=1e-4)


# the PP layouts run under tests/runtime/sync_guard.py's check (a device-wide synchronise while a
# gradient-norm all-reduce is pending fails the run)
LAYOUTS = {"pp2": dict(pp=2), "dp2": dict(dp=2), "tp2": dict(tp=2),
           "tp2_sp": dict(tp=2, sequence_parallel=True), "pp2_recompute": dict(pp=2, recompute=True),
           # the TP collectives overlapped with compute (parallelism.tp_overlap: on; auto is off), with SP
           # and recompute, and without SP (all-reduces in nano-batches)
           "tp2_sp_overlap": dict(tp=2, sequence_parallel=True, recompute=True, tp_overlap="on"),
           "tp2_overlap": dict(tp=2, tp_overlap="on"),
           # uneven stages (3 + 1 of tiny-llama's 4 layers) with the first 2 of each stage recomputed
           "pp2_uneven_partial_recompute": dict(pp=2, stage_layers=[3, 1], recompute=True,
                                                recompute_layers=2),
           # interleaved 1F1B: two model chunks of one layer per rank (a ring of two ranks), with and without
           # recompute; the jobs step inside the pipeline (two global batches per chunk)
           "pp2_v2": dict(pp=2, virtual_stages=2),
           "pp2_v2_recompute": dict(pp=2, virtual_stages=2, recompute=True),
           # virtual_stages: auto, chosen by the run plan after the process groups exist (here the one count
           # the four stage counts allow: two model chunks a rank)
           "pp2_vauto": dict(pp=2, virtual_stages="auto", stage_layers=[1, 1, 1, 1])}


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.two_process(name, jobs=three_job_dicts, guard=bool(layout.get("pp")),
                                                     **layout))
    for name, layout in LAYOUTS.items()])
def test_two_process_runs_equal_single_process(three_jobs, two_process, name):
    tmp, jobs, summary, out = three_jobs
    two = two_process(name)
    # Same training: per-step losses and full-adapter gradient norms (clipping input) agree to fp32
    # noise; final weights agree tensor-wise to 1e-4 (AdamW scales gradient noise of ~eps-sized elements
    # by lr/eps, and TP/PP sum partial products in another order than one process).
    ours = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    key = lambda r: (r["job"], r["step"])  # noqa: E731
    ours, ref = sorted(ours, key=key), sorted(ref, key=key)
    assert [key(r) for r in ours] == [key(r) for r in ref]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    for job in ("rev", "up", "rev2"):
        assert_close(load_adapter(two, job), load_adapter(out, job), rel=1e-4)
    s = json.loads((two / "summary.json").read_text())
    assert s["run_plan"]["tp_overlap"] == (2 if LAYOUTS[name].get("tp_overlap") else 0)
    if LAYOUTS[name].get("virtual_stages") == "auto":
        chosen = s["run_plan"]["virtual_stages"]["chosen"]
        assert s["run_plan"]["parallelism"]["virtual_stages"] == 2 == chosen
    if LAYOUTS[name].get("pp"):
        assert s["bubble_ratio"] is not None and 0 <= s["bubble_ratio"] < 1
