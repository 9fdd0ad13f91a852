"""The benchmark harness's order controls: Triton JIT work counted per chunk (scripts/bench_jit.py)
and the auto-vs-hand-picked sweep's summary (scripts/e2e_sweep.py)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_jit import JitClock  # noqa: E402
from e2e_sweep import summarise  # noqa: E402


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
