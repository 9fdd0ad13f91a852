"""The attention benchmark's CPU dry run through its device script (scripts/device/attention_bench.sh →
scripts/bench_attention.py --dry-run): tiny shapes, the exact reference as the candidate, the record's fields;
and the packed microbatches it times are the bench data's length mix filled up to a capacity."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_attention import packed_lengths  # noqa: E402


def test_packed_microbatches_fill_the_capacity_with_the_length_mix():
    for cap in (4096, 11776, 13312):
        lengths = packed_lengths(cap)
        assert cap - 128 <= sum(lengths) <= cap and all(18 <= n <= 4096 for n in lengths)
        assert len(set(lengths)) > 3  # mixed lengths, not one repeated
    assert packed_lengths(None) == [4096] and packed_lengths(11776, seed=1) != packed_lengths(11776)


@pytest.mark.slow
def test_the_device_script_runs_the_cpu_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, ARGS="--dry-run", GPU_TESTS="0",
               OMP_NUM_THREADS="1", BENCH_COMMIT="abc1234")
    p = subprocess.run(["bash", "scripts/device/attention_bench.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "bench rc=0" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "attention-gpu.json").read_text())  # no nvidia-smi: "gpu"
    assert rec["device"] == "cpu" and rec["commit"] == "abc1234" and "bench_attention.py" in rec["command"]
    assert rec["order"] == ["per-sample"] and set(rec["shapes"]) == {"mix96", "one40"}
    got = rec["shapes"]["mix96"]["candidates"]["per-sample"]
    assert got["fwd_ms"] > 0 and got["fwd_bwd_ms"] > 0 and got["error_vs_fp32"]["dq"]["max_abs"] == 0.0
    assert got["saved_elems_per_token"] > 0
