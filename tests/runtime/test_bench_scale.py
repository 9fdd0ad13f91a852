"""The plumbing of the GPU scale runs on CPU, in one launch: scripts/device/scale.sh's CPU run (the quickstart
config, PP=2, two gloo processes under torchrun) → scripts/bench_train.py → our run plus both baselines (one
job at a time with a flush per global batch; fused kernels off) → the scale record rank 0 writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scale_script_runs_its_cpu_plumbing_run_with_baselines(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU="2", GPU_TESTS="0", BASELINES="1", BASELINE_TIMED="1",
               OUT=str(tmp_path / "out"), BENCH_TMP=str(tmp_path), PYTHON=sys.executable,
               BENCH_COMMIT="abc1234")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", "scripts/device/scale.sh", "tiny-pp2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400)
    log = tmp_path / "out" / "tiny-pp2.log"
    assert p.returncode == 0, (p.stdout[-3000:] + p.stderr[-2000:]
                               + (log.read_text()[-4000:] if log.exists() else ""))
    # rank 0 alone prints; the JSON is its last line
    last = json.loads(log.read_text().strip().splitlines()[-1])
    assert last["world_size"] == 2 and "hf_peft" not in last
    rec = json.loads((tmp_path / "out" / "tiny-pp2.json").read_text())
    for key in ("tokens_per_s", "bubble_ratio", "steps_per_job", "peak_mem_gib", "device",
                "commit", "command"):
        assert key in rec, key
    assert rec["tokens_per_s"] > 0 and rec["steps_per_job"] == 2 and rec["commit"] == "abc1234"
    assert (rec["device"] == "2x cpu" and rec["command"].startswith(sys.executable)
            and "--scale-json" in rec["command"])
    assert len(rec["peak_mem_gib"]) == 2 and len(rec["bubble_ratio_per_rank"]) == 2
    # steady state: the per-chunk bubbles of the timed chunks (4 steps, lookahead 2: chunk 1 of 0..1)
    for per_chunk, steady in zip(rec["bubble_per_chunk_per_rank"], rec["bubble_ratio_per_rank"], strict=True):
        assert len(per_chunk) == 2 and steady == pytest.approx(per_chunk[1])
    assert 0 <= rec["bubble_ratio"] < 1 and rec["parallelism"]["pp"] == 2
    # baselines: scheduler off first (each of the 3 jobs alone, lookahead 1: 1 warm-up + 1 timed step), then
    # fused kernels off (one warm-up chunk + one timed chunk of the config's lookahead 2)
    assert (rec["scheduler_off"]["runs"] == 3
            and rec["scheduler_off"]["overrides"] == ["scheduler.lookahead_batches=1"])
    assert rec["baseline_steps_per_job"] == {"scheduler_off": {"steps": 2, "warmup": 1},
                                             "reference": {"steps": 4, "warmup": 2}}
    assert rec["reference"]["kernels"] == "reference" and rec["speedup_vs_scheduler_off"] > 0
