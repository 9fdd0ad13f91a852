"""TP=2 x PP=2 on four processes with the TP collectives overlapped with compute (``parallelism.tp_overlap:
on``; sequence parallelism, recompute) trains exactly like one process: per-step losses, gradient norms and
the final adapters. (Two-process TP=2 runs with overlap are in test_distributed.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_utils import assert_close, load_adapter, three_job_dicts, train_inprocess, write_run

ROOT = Path(__file__).resolve().parents[2]


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["job"], r["step"]))


@pytest.mark.slow
def test_four_process_tp2_pp2_with_overlap_equals_one_process(tmp_path, megatron_single):
    jobs = three_job_dicts(tmp_path)
    _, ref = train_inprocess(write_run(tmp_path, jobs, out="one", name="one.yaml"))
    run = write_run(tmp_path, jobs, out="four", name="four.yaml", tp=2, pp=2, sequence_parallel=True,
                    recompute=True, tp_overlap="on")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         "-m", "lorafusion.cli", "train", str(run)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    four = tmp_path / "four"
    ours, theirs = _metrics(four), _metrics(ref)
    assert [(r["job"], r["step"]) for r in ours] == [(r["job"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    for job in ("rev", "up", "rev2"):
        assert_close(load_adapter(four, job), load_adapter(ref, job), rel=1e-4)
    summary = json.loads((four / "summary.json").read_text())
    assert summary["run_plan"]["tp_overlap"] == 2 and summary["parallelism"]["tp"] == 2
