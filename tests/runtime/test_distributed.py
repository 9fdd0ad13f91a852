"""Two processes (PP=2, DP=2, TP=2, TP=2 with sequence parallelism, PP=2 with recompute) train exactly like one."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_utils import assert_close, job_dict, load_adapter, train_inprocess, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_two_processes(run: Path, guard: bool = False) -> list[str]:
    """Both ranks of ``lorafusion train RUN``; ``guard``: through tests/runtime/sync_guard.py (a device-wide
    synchronise while a gradient-norm all-reduce is pending fails the run)."""
    port = str(_free_port())
    entry = [str(Path(__file__).with_name("sync_guard.py"))] if guard else ["-m", "lorafusion.cli"]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *entry, "train", str(run)], cwd=ROOT,
                                      env=dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return outs


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["job"], r["step"]))


@pytest.mark.slow
def test_dp2_with_whole_global_batches_in_one_microbatch_equals_dp1(tmp_path, megatron_single):
    """The quickstart shape at dp=2: a large token capacity (a global batch fits one microbatch) and a job
    of one sample per step (which one DP rank alone can hold). Both ranks step every job in lockstep
    (the one without a microbatch of it reduces zero gradients) and the result equals dp=1 per step."""
    jobs = [job_dict("a", write_dataset(tmp_path / "d" / "a.jsonl", 1), r=4, steps=5, gbs=8),
            job_dict("b", write_dataset(tmp_path / "d" / "b.jsonl", 2, kind="upper"), r=8, steps=5, gbs=1),
            job_dict("c", write_dataset(tmp_path / "d" / "c.jsonl", 3), r=4, steps=4, gbs=3)]
    _, ref = train_inprocess(write_run(tmp_path, jobs, out="dp1", capacity=1024, name="dp1.yaml"))
    run = write_run(tmp_path, jobs, out="dp2", dp=2, capacity=1024, name="dp2.yaml")
    _train_two_processes(run)
    ours, theirs = _metrics(tmp_path / "dp2"), _metrics(ref)
    assert [(r["job"], r["step"]) for r in ours] == [(r["job"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    for job in ("a", "b", "c"):
        assert_close(load_adapter(tmp_path / "dp2", job), load_adapter(ref, job), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(dp=2), dict(tp=2), dict(tp=2, sequence_parallel=True),
                                    dict(pp=2, recompute=True)])
def test_two_process_runs_equal_single_process(three_jobs, tmp_path, layout):
    tmp, jobs, summary, out = three_jobs
    name = "_".join(f"{k}{v}" for k, v in layout.items()).replace("sequence_parallelTrue", "sp")
    run = write_run(tmp_path, jobs, out=name, **layout)
    _train_two_processes(run, guard=bool(layout.get("pp")))
    # Same training: per-step losses and full-adapter gradient norms (clipping input) agree to fp32
    # noise; final weights agree tensor-wise to 1e-4 (AdamW scales gradient noise of ~eps-sized elements
    # by lr/eps, and TP/PP sum partial products in another order than one process).
    ours = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    key = lambda r: (r["job"], r["step"])  # noqa: E731
    ours, ref = sorted(ours, key=key), sorted(ref, key=key)
    assert [key(r) for r in ours] == [key(r) for r in ref]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    for job in ("rev", "up", "rev2"):
        assert_close(load_adapter(tmp_path / name, job), load_adapter(out, job), rel=1e-4)
    s = json.loads((tmp_path / name / "summary.json").read_text())
    if layout.get("pp"):
        assert s["bubble_ratio"] is not None and 0 <= s["bubble_ratio"] < 1
