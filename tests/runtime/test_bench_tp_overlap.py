"""The TP-overlap benchmark (scripts/bench_tp_overlap.py, scripts/device/tp_overlap.sh): how it reads a
profile (the collectives' time and the part hidden under compute kernels), its chunk schedule, and its CPU
plumbing run (the quickstart at TP=2 on two gloo processes, modes alternated inside one run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_tp_overlap as B  # noqa: E402


def test_collective_kernels_are_told_from_compute_by_their_nccl_names():
    assert B.comm_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "AllGather"
    assert B.comm_kind("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16") == "ReduceScatter"
    assert B.comm_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "AllReduce"
    assert B.comm_kind("sm90_xmma_gemm_bf16bf16_bf16f32") is None
    assert B.comm_kind("void at::native::elementwise_kernel<128, 4>") is None


def test_overlap_summary_counts_the_collective_time_spent_under_compute():
    k = [("ncclDevKernel_AllGather", 0, 100), ("gemm", 50, 250),  # compute: 50..260 (the two GEMMs overlap)
         ("ncclDevKernel_ReduceScatter", 200, 300), ("gemm2", 240, 260),
         ("ncclDevKernel_AllReduce", 400, 410)]  # alone: exposed
    s = B.overlap_summary(k)
    assert s["collective_ms"] == pytest.approx(0.210)  # 100 + 100 + 10 us
    assert s["collective_ms_by_kind"] == pytest.approx({"AllGather": 0.1, "ReduceScatter": 0.1,
                                                        "AllReduce": 0.01})
    assert s["hidden_ms"] == pytest.approx(0.110)  # 0..100 ∩ 50..260 = 50, 200..300 ∩ 50..260 = 60
    assert s["hidden_frac"] == pytest.approx(110 / 210)
    assert s["compute_ms"] == pytest.approx(0.210) and s["window_ms"] == pytest.approx(0.410)
    assert B.overlap_summary([("gemm", 0, 5)])["hidden_frac"] is None


def test_schedule_warms_every_mode_then_alternates_in_reversed_rounds():
    s = B.schedule([2, 4], timed=2, profile=True)
    assert [(m, k) for m, _, k in s] == [
        ("off", "warmup"), ("on2", "warmup"), ("on4", "warmup"),
        ("off", "timed"), ("on2", "timed"), ("on4", "timed"),
        ("on4", "timed"), ("on2", "timed"), ("off", "timed"),
        ("off", "profile"), ("on2", "profile"), ("on4", "profile")]
    assert {m: n for m, n, _ in s} == {"off": 0, "on2": 2, "on4": 4}


@pytest.mark.slow
def test_device_script_runs_its_cpu_plumbing_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU="2", GPU_TESTS="0", OUT=str(tmp_path / "out"),
               BENCH_TMP=str(tmp_path), PYTHON=sys.executable, BENCH_COMMIT="abc1234",
               CONFIG="configs/quickstart.yaml", CAPACITY="1024", LOOKAHEAD="1", TIMED="2", NANO="2")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", "scripts/device/tp_overlap.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=400)
    log = tmp_path / "out" / "tp-overlap.log"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:] + (log.read_text()[-4000:] if log.exists()
                                                                        else "")
    rec = json.loads((tmp_path / "out" / "tp-overlap-2xcpu.json").read_text())
    assert set(rec["tokens_per_s"]) == {"off", "on2"} and all(v > 0 for v in rec["tokens_per_s"].values())
    assert rec["modes"]["off"]["chunks"] == rec["modes"]["on2"]["chunks"] == 2
    assert rec["speedup_vs_off"]["on2"] > 0 and rec["commit"] == "abc1234" and rec["device"] == "2x cpu"
    assert "--nano 2" in rec["command"]
    assert rec["parallelism"] == {"tp": 2, "pp": 1, "sequence_parallel": True}
    # the modes alternated inside the run, after one warm-up chunk each, then one profiled chunk each
    assert [(c["mode"], c["kind"]) for c in rec["chunks"]] == [
        ("off", "warmup"), ("on2", "warmup"), ("off", "timed"), ("on2", "timed"), ("on2", "timed"),
        ("off", "timed"), ("off", "profile"), ("on2", "profile")]
