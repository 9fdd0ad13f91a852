"""DataBatcher: MILP optimal on tiny instances (brute force), never worse than greedy, time-limit path."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lorafusion.scheduler.milp as milp_mod
from lorafusion.scheduler import (
    DataBatcher,
    JobSpec,
    PlanError,
    SampleTooLongError,
    SchedulerConfig,
    first_fit_decreasing,
    greedy_pack,
    lower_bound,
    pack_objective,
    plan,
    verify_plan,
)


def set_partitions(items: list[int]):
    """All partitions of ``items`` into non-empty blocks (Bell-number many)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield part[:k] + [[first, *part[k]]] + part[k + 1 :]


def brute_force(w: list[int], cap: int) -> tuple[int, int]:
    best = None
    for part in set_partitions(list(range(len(w)))):
        loads = [sum(w[i] for i in b) for b in part]
        if max(loads) <= cap:
            obj = pack_objective(loads)
            best = obj if best is None or obj < best else best
    return best


def _bins_valid(bins, w, cap):
    flat = sorted(i for b in bins for i in b)
    return flat == list(range(len(w))) and all(sum(w[i] for i in b) <= cap for b in bins)


TINY = [([3, 3, 3, 3, 4, 4], 10), ([6, 5, 5, 4], 10), ([7, 6, 5, 4, 3, 2, 2], 12)] + [
    ([random.Random(s).randint(1, 9) for _ in range(random.Random(s + 99).randint(4, 7))], 10)
    for s in range(9)
]


@pytest.mark.parametrize("w,cap", TINY)
def test_milp_matches_brute_force(w, cap):
    res = DataBatcher(cap, time_limit_s=60.0, solver="cbc", gap=0.0).pack(w)
    assert _bins_valid(res.bins, w, cap)
    assert res.objective == brute_force(w, cap)
    assert lower_bound(w, cap) <= res.num_bins


def test_milp_beats_greedy_where_greedy_is_suboptimal():
    w, cap = [3, 3, 3, 3, 4, 4], 10  # FFD: [4,4] [3,3,3] [3] -> 3 bins; optimum [4,3,3] x 2
    greedy = greedy_pack(w, cap)
    assert len(greedy) == 3
    # generous: a loaded CI machine slows CBC, not the answer
    res = DataBatcher(cap, time_limit_s=60.0).pack(w)
    assert res.num_bins == 2 and res.source == "milp" and res.count_optimal


lengths = st.lists(st.integers(1, 40), min_size=1, max_size=14)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=lengths, cap=st.integers(40, 60))
def test_never_worse_than_greedy(w, cap):
    res = DataBatcher(cap, time_limit_s=0.15).pack(w)
    greedy = greedy_pack(w, cap)
    assert _bins_valid(res.bins, w, cap)
    assert res.objective <= pack_objective([sum(w[i] for i in b) for b in greedy])
    assert len(greedy) <= len(first_fit_decreasing(w, cap))
    assert res.num_bins >= lower_bound(w, cap)


def _canon(bins):
    return sorted(tuple(sorted(b)) for b in bins)


def test_time_limit_zero_returns_greedy():
    w, cap = [3, 3, 3, 3, 4, 4], 10
    res = DataBatcher(cap, time_limit_s=0.0).pack(w)
    assert res.source == "greedy" and res.timed_out
    assert _canon(res.bins) == _canon(greedy_pack(w, cap))


def test_solver_timeout_without_solution_returns_greedy(monkeypatch):
    calls = []

    def no_solution(prob, kind, deadline, gap=0.0):  # what a solver stopped by its time limit reports
        calls.append(prob.name)
        return 0

    monkeypatch.setattr(milp_mod, "_solve", no_solution)
    w, cap = [3, 3, 3, 3, 4, 4], 10
    # generous: a loaded CI machine slows CBC, not the answer
    res = DataBatcher(cap, time_limit_s=60.0).pack(w)
    assert calls, "the MILP path was not taken"
    assert res.source == "greedy" and res.timed_out
    assert _canon(res.bins) == _canon(greedy_pack(w, cap))


def test_large_instance_respects_time_limit_and_neighbourhood():
    rng = random.Random(0)
    w = [min(4096, int(rng.lognormvariate(7.3, 0.6))) for _ in range(200)]
    res = DataBatcher(4096, time_limit_s=0.3, max_vars=3000).pack(w)
    assert _bins_valid(res.bins, w, 4096)
    # (unbounded it runs on: 15 s with a 30 s limit; the margin covers a loaded machine delaying the solver)
    assert res.solve_s < 0.3 + 1.5
    assert res.objective <= pack_objective([sum(w[i] for i in b) for b in greedy_pack(w, 4096)])


def test_highs_requested_without_highspy_is_a_clear_error():
    if milp_mod.highs_available():
        pytest.skip("highspy is installed")
    with pytest.raises(PlanError, match="highspy"):
        DataBatcher(10, time_limit_s=1.0, solver="highs").pack([3, 3, 3, 3, 4, 4])


def test_sample_longer_than_capacity_names_job_and_sample():
    job = JobSpec("alpaca", [[("s0", 10), ("s1", 5000)]], 2)
    with pytest.raises(SampleTooLongError, match=r"'alpaca'.*'s1'"):
        plan([job], SchedulerConfig(token_capacity=4096))


def test_truncating_job_is_cut_to_capacity():
    job = JobSpec("alpaca", [[("s0", 10), ("s1", 5000)]], 2, truncate=True)
    p = plan([job], SchedulerConfig(token_capacity=4096, milp_time_limit_s=0.1))
    verify_plan(p, [job], 1, 1)
    sizes = {e.sample_id: e.num_tokens for mb in p.microbatches for e in mb.entries}
    assert sizes == {"s0": 10, "s1": 4096}
