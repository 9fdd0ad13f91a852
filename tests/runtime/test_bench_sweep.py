"""The benchmark harness's order controls: Triton JIT work counted per chunk (scripts/bench_jit.py)
and the auto-vs-hand-picked sweep's summary (scripts/e2e_sweep.py): its entries (precision, capacity,
overrides), each timed chunk's tokens/s pooled per configuration, and a CPU run of bf16 then FP8 at bf16's
capacity."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_jit import JitClock  # noqa: E402
from bench_train import chunk_tokens  # noqa: E402
from lorafusion.core.procenv import PROCESS_ENV  # noqa: E402
from e2e_sweep import parse_spec, per_chunk, run_name, run_record, spec_overrides, spread, summarise  # noqa: E402


def test_jit_clock_counts_compilations_per_chunk_and_restores_the_hooks():
    seen = []
    knobs = SimpleNamespace(jit_cache_hook=lambda **kw: seen.append("prev") or None,
                            jit_post_compile_hook=None)
    prev = knobs.jit_cache_hook
    clock = JitClock(knobs)
    assert knobs.jit_cache_hook is not prev
    assert knobs.jit_cache_hook(key="k") is None and seen == ["prev"]  # chained, and the compile goes ahead
    knobs.jit_post_compile_hook(key="k")
    clock.chunk_ran(None, None, None)  # chunk 0 (warm-up): one compilation
    clock.chunk_ran(None, None, None)  # chunk 1: none
    knobs.jit_cache_hook(key="a")
    knobs.jit_post_compile_hook(key="a")
    knobs.jit_cache_hook(key="b")
    knobs.jit_post_compile_hook(key="b")
    clock.chunk_ran(None, None, None)  # chunk 2: two
    s = clock.summary(first_timed=1)
    assert ([c["n"] for c in s["jit_per_chunk"]] == [1, 0, 2] and s["jit_timed_n"] == 2
            and s["jit_timed_s"] >= 0)
    clock.close()
    assert knobs.jit_cache_hook is prev and knobs.jit_post_compile_hook is None


def test_jit_clock_passes_a_previous_hooks_skip_through():
    knobs = SimpleNamespace(jit_cache_hook=lambda **kw: True, jit_post_compile_hook=None)
    clock = JitClock(knobs)
    assert knobs.jit_cache_hook(key="k") is True  # the earlier hook asked Triton to skip: still skipped
    clock.close()


def _run(i, name, tps, cap):
    return {"index": i, "name": name, "tokens_per_s": tps, "token_capacity": cap}


def test_sweep_summary_compares_medians_over_all_runs_and_without_the_first():
    runs = [_run(0, "auto", 15200, 23040), _run(1, "hand24576", 16100, 24576),
            _run(2, "hand20480", 15900, 20480), _run(3, "auto", 16000, 23040)]
    s = summarise(runs)
    assert s["order"] == ["auto", "hand24576", "hand20480", "auto"] and s["auto_token_capacity"] == [23040]
    assert s["per_config"]["auto"] == {"tokens_per_s": [15200, 16000], "median": 15600}
    assert s["best_hand_picked"] == "hand24576"
    assert (s["auto_over_best_hand_picked"] == pytest.approx(15600 / 16100, abs=1e-4)
            and s["within_3pct"] is False)
    rest = s["excluding_first_run"]
    assert rest["first_run"] == "auto" and rest["per_config"]["auto"]["tokens_per_s"] == [16000]
    assert rest["auto_over_best_hand_picked"] == pytest.approx(16000 / 16100, abs=1e-4)
    assert s["within_3pct_excluding_first_run"] is True
    slow = summarise([_run(0, "auto", 15000, 23040), _run(1, "hand24576", 16100, 24576)])
    assert slow["within_3pct"] is False and slow["excluding_first_run"]["auto_over_best_hand_picked"] is None


def test_sweep_summary_without_a_finished_run_of_a_side_gives_no_ratio():
    s = summarise([_run(0, "auto", None, None), _run(1, "hand12288", 14900, 12288)])
    assert s["auto_over_best_hand_picked"] is None and s["within_3pct"] is None


def test_sweep_refuses_an_order_entry_that_is_not_auto_or_a_capacity(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "scripts/e2e_sweep.py"), "--order", "auto,12k",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "'12k' is neither auto nor a token capacity" in p.stderr


def test_sweep_entries_give_precision_capacity_and_overrides():
    assert parse_spec("auto") == (None, "auto") and run_name("12288") == "hand12288"
    assert parse_spec("fp8:13312") == ("fp8", "13312") and run_name("fp8:auto") == "fp8-auto"
    assert run_name("bf16:auto+model.attention=fa2") == "bf16-auto+model.attention=fa2"
    assert spec_overrides("bf16:auto+model.attention=fa2", None) == ["model.base_precision=bf16",
                                                                     "model.attention=fa2"]
    assert spec_overrides("fp8:bf16cap", 11776) == [
        "model.base_precision=fp8", "scheduler.token_capacity=11776", "model.recompute=false",
        "model.recompute_layers=null"]
    for bad, why in (("fp16:auto", "neither auto nor"), ("auto+fa2", "KEY=VALUE")):
        with pytest.raises(SystemExit, match=why):
            parse_spec(bad)
    with pytest.raises(SystemExit, match="needs a bf16 auto run before it"):
        spec_overrides("fp8:bf16cap", None)


def test_each_timed_chunk_gives_its_own_tokens_per_s():
    # metrics rows: 2 jobs, lookahead 2 -> chunk c holds steps 2c+1 and 2c+2 of each job
    rows = [{"job": j, "step": st, "tokens": 10 * st} for j in ("a", "b") for st in range(1, 7)]
    assert chunk_tokens(rows, 2) == [60, 140, 220]
    bench = {"lorafusion": {"chunk_s": [30.0, 7.0, 11.0], "chunk_tokens": [60, 140, 220],
                            "tokens_per_s": 19.0, "memory_plan": {"token_capacity": 11776}}}
    r = run_record(0, "bf16:auto", bench, 60.0, None, 0, warmup_chunks=1)
    assert r["chunk_tokens_per_s"] == [20.0, 20.0] and r["token_capacity"] == 11776
    assert r["precision"] == "bf16"


def test_chunks_of_one_configuration_are_pooled_and_fp8_is_compared_with_bf16():
    runs = [{"name": "bf16-auto", "chunk_tokens_per_s": [100.0, 104.0, 98.0]},
            {"name": "fp8-auto", "chunk_tokens_per_s": [121.0, 119.0]},
            {"name": "bf16-auto", "chunk_tokens_per_s": [102.0]},
            {"name": "fp8-auto", "chunk_tokens_per_s": [120.0, 126.0]}]
    got = per_chunk(runs)
    assert got["per_config"]["bf16-auto"] == spread([100.0, 104.0, 98.0, 102.0])
    assert got["per_config"]["bf16-auto"]["median"] == 101.0 and got["per_config"]["fp8-auto"]["n"] == 4
    assert got["per_config"]["bf16-auto"]["range_pct"] == pytest.approx(100 * 6 / 101, abs=0.01)
    assert got["fp8-auto_over_bf16-auto"] == pytest.approx(120.5 / 101, abs=1e-4)
    assert spread([]) == {"n": 0}


@pytest.mark.slow
def test_sweep_runs_bf16_then_fp8_at_bf16s_capacity_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_COMMIT="abc1234")
    p = subprocess.run([sys.executable, str(ROOT / "scripts/e2e_sweep.py"), "--config",
                        "configs/quickstart.yaml", "--overrides", "model.dtype=bfloat16",
                        "--order", "bf16:auto,fp8:bf16cap",
                        "--timed-chunks", "1", "--timeout", "400", "--out", str(tmp_path / "e2e"),
                        "--json", str(tmp_path / "e2e.json")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((tmp_path / "e2e.json").read_text())
    assert [r["rc"] for r in s["runs"]] == [0, 0] and s["commit"] == "abc1234"
    assert s["runs"][1]["token_capacity"] == s["runs"][0]["token_capacity"] == 1024  # fp8 at bf16's capacity
    assert s["env"] == PROCESS_ENV and s["timed_chunks_per_run"] == 1  # the CLI's allocator settings
    assert s["per_chunk"]["per_config"]["fp8-bf16cap"]["n"] == 1
    assert "fp8-bf16cap_over_bf16-auto" in s["per_chunk"]
