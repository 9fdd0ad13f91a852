"""The plumbing of the GPU scale runs (scripts/device/scale.sh → scripts/bench_train.py under torchrun), on
CPU: two gloo processes, PP=2, the tiny model, our run plus both baselines, and the scale record rank 0
writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_utils import job_dict, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_train_under_torchrun_writes_the_scale_record(tmp_path):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, dropout=0.1, steps=4),
            job_dict("up", write_dataset(tmp_path / "d" / "up.jsonl", 2, kind="upper"), r=8, gbs=3, steps=4)]
    run = write_run(tmp_path, jobs, pp=2, out="unused")
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_COMMIT="abc1234")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    record = tmp_path / "results" / "tiny-pp2-2proc.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "scripts" / "bench_train.py"), "--config", str(run), "--steps", "4", "--warmup", "2",
           "--ablate", "--flush-per-batch", "--out", str(tmp_path / "bench"), "--scale-json", str(record)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])  # rank 0 alone prints; the JSON is its last line
    assert last["world_size"] == 2 and "hf_peft" not in last
    rec = json.loads(record.read_text())
    for key in ("tokens_per_s", "bubble_ratio", "steps_per_job", "peak_mem_gib", "device", "commit", "command"):
        assert key in rec, key
    assert rec["tokens_per_s"] > 0 and rec["steps_per_job"] == 2 and rec["commit"] == "abc1234"
    assert rec["device"] == "2x cpu" and "bench_train.py" in rec["command"]
    assert len(rec["peak_mem_gib"]) == 2 and len(rec["bubble_ratio_per_rank"]) == 2
    # steady state: the per-chunk bubbles of the timed chunks (4 steps, lookahead 2: chunk 1 of 0..1)
    for per_chunk, steady in zip(rec["bubble_per_chunk_per_rank"], rec["bubble_ratio_per_rank"], strict=True):
        assert len(per_chunk) == 2 and steady == pytest.approx(per_chunk[1])
    assert 0 <= rec["bubble_ratio"] < 1 and rec["parallelism"]["pp"] == 2
    assert rec["scheduler_off"]["runs"] == 2 and rec["scheduler_off"]["overrides"] == ["scheduler.lookahead_batches=1"]
    assert rec["reference"]["kernels"] == "reference" and rec["speedup_vs_scheduler_off"] > 0


@pytest.mark.slow
def test_scale_script_runs_its_cpu_plumbing_run(tmp_path):
    """scripts/device/scale.sh end to end with its CPU run (quickstart config, PP=2, two gloo processes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU="2", GPU_TESTS="0", BASELINES="0", OUT=str(tmp_path / "out"),
               BENCH_TMP=str(tmp_path), PYTHON=sys.executable, BENCH_COMMIT="abc1234")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", "scripts/device/scale.sh", "tiny-pp2"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    log = tmp_path / "out" / "tiny-pp2.log"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:] + (log.read_text()[-4000:] if log.exists() else "")
    rec = json.loads((tmp_path / "out" / "tiny-pp2.json").read_text())
    assert rec["steps_per_job"] == 2 and len(rec["peak_mem_gib"]) == 2 and rec["bubble_ratio"] is not None
    assert rec["command"].startswith(sys.executable) and "--scale-json" in rec["command"]
    assert "scheduler_off" not in rec  # BASELINES=0
