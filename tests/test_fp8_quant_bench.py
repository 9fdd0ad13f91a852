"""The FP8 row-quantization benchmark (scripts/bench_fp8_quant.py) through its device script on the CPU (a dry
run: every launch once in Triton's interpreter, the record's fields), and its per-layer sums."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_fp8_quant as B  # noqa: E402


def _row(ms, equal=True):
    return {"ms": ms, "equal": equal}


def test_layer_sums_weigh_each_shape_by_its_calls_and_never_pick_an_inexact_launch():
    res = {name: {"shipped": _row(2.0), "divide": _row(1.0, False), "fast_wrong": _row(0.5, False),
                  "other": _row(1.5), "_copy": {"ms": 0.1}} for name, *_ in B.SHAPES}
    calls = sum(c for *_, c in B.SHAPES)
    got = B.layer_ms(res)
    assert got["ms"] == {"divide": calls * 1.0, "shipped": calls * 2.0, "best": calls * 1.5}
    assert set(got["best_launch"].values()) == {"other"} and got["shipped_vs_divide"] == 0.5
    assert calls == 8  # X of qkv, proj, fc1, fc2 and dY of the same four linears


@pytest.mark.slow
def test_the_device_script_runs_the_cpu_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, GPU_TESTS="0", TOKENS="4",
               VARIANTS="all", OMP_NUM_THREADS="1", BENCH_COMMIT="abc1234")
    p = subprocess.run(["bash", "scripts/device/fp8_quant.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "bench rc=0" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "fp8_quant.json").read_text())
    assert rec["device"] == "cpu" and rec["commit"] == "abc1234"
    res = rec["fp8_quant"]
    assert res["tokens"] == 4 and {name for name, *_ in B.SHAPES} <= set(res)
    for name, n, has_cs, _ in B.SHAPES:
        assert set(res[name]) == set(B.variants(name, "all"))
        assert res[name]["shipped"]["launch"] == list(B.Q.launch(n, has_cs))
    assert set(res["transpose"]) == {"qkv", "proj", "fc1", "fc2"}
    assert all(row["equal"] for row in res["transpose"].values())
