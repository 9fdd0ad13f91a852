"""verify.py: the 1F1B-derived dependency distance, hand-made violations, planner output always passes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafusion.scheduler import (
    Entry,
    JobSpec,
    Microbatch,
    PackedMicrobatch,
    Plan,
    PlanError,
    SchedulerConfig,
    dependency_distance,
    plan,
    sequence,
    verify_plan,
)
from lorafusion.scheduler.simulate import one_f_one_b_order, simulate_1f1b


@pytest.mark.parametrize("S", [1, 2, 3, 4, 6])
def test_dependency_distance_matches_1f1b_op_order(S):
    """On stage 0, B(t) must come before F(t + d) and after F(t + d - 1): d is the exact distance."""
    d = dependency_distance(S)
    m = 3 * S + 5
    order = one_f_one_b_order(S, 0, m)
    pos = {op: k for k, op in enumerate(order)}
    for t in range(m - d):
        assert pos["B", t] < pos["F", t + d]
        if d >= 2:
            assert pos["B", t] > pos["F", t + d - 1]
    # and every later stage needs less: B(t) on stage s precedes F(t + S - s)
    for s in range(S):
        o = one_f_one_b_order(S, s, m)
        p = {op: k for k, op in enumerate(o)}
        assert all(p["B", t] < p["F", t + S - s] for t in range(m - S))


def test_simulated_timeline_respects_the_rule():
    """With zero-cost no-ops the next batch's first forward starts after the last backward (stage 0)."""
    S = 4
    fw = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    tl = simulate_1f1b(fw, S, noop=[False, False, True, True, True, False])
    assert tl.op(0, 5, "F").start >= tl.op(0, 1, "B").end


# ---------------------------------------------------------------- hand-made plans

def E(job, batch, sid, n=10):
    return Entry(job, batch, sid, n)


def make_plan(slots, S=2, dp=1, cap=100, ready=None):
    mbs = []
    last = {}
    for k, entries in enumerate(slots):
        entries = tuple(entries)
        mbs.append(Microbatch(k, k // dp, k % dp, entries, is_noop=not entries))
        for e in entries:
            last[e.job, e.batch] = k
    return Plan(mbs, S, dp, cap, last, dict(ready or {}))


JOB_A = JobSpec("A", [[("a0", 10)], [("a1", 10)]], 1)
JOB_B = JobSpec("B", [[("b0", 10), ("b1", 10)]], 2)


def test_accepts_valid_plan_with_noop():
    p = make_plan([[E("A", 0, "a0")], [], [E("A", 1, "a1")]], S=2)
    rep = verify_plan(p, [JOB_A], 2, 1)
    assert rep.num_noops == 1 and rep.num_samples == 2 and rep.min_gap == {"A": 2}


def test_rejects_dependency_violation_naming_job_batch_microbatch():
    p = make_plan([[E("A", 0, "a0")], [E("A", 1, "a1")]], S=2)
    with pytest.raises(PlanError, match=r"job 'A' batch 1 .*microbatch 1.*distance >= 2, got 1"):
        verify_plan(p, [JOB_A], 2, 1)
    verify_plan(make_plan([[E("A", 0, "a0")], [E("A", 1, "a1")]], S=1), [JOB_A], 1, 1)


def test_rejects_batch_order_swapped():
    p = make_plan([[E("A", 1, "a1")], [], [], [E("A", 0, "a0")]], S=2)
    with pytest.raises(PlanError, match="job 'A' batch 1"):
        verify_plan(p, [JOB_A], 2, 1)


def test_rejects_missing_and_duplicate_and_foreign_samples():
    with pytest.raises(PlanError, match="sample 'b1' is missing"):
        verify_plan(make_plan([[E("B", 0, "b0")]]), [JOB_B], 2, 1)
    with pytest.raises(PlanError, match="'b0' appears twice"):
        verify_plan(make_plan([[E("B", 0, "b0"), E("B", 0, "b1")], [E("B", 0, "b0")]]), [JOB_B], 2, 1)
    with pytest.raises(PlanError, match="not in the jobs' input"):
        verify_plan(make_plan([[E("B", 0, "b0"), E("B", 0, "b1"), E("B", 0, "zz")]]), [JOB_B], 2, 1)
    with pytest.raises(PlanError, match="has 11 tokens, expected 10"):
        verify_plan(make_plan([[E("B", 0, "b0"), E("B", 0, "b1", 11)]]), [JOB_B], 2, 1)


def test_rejects_capacity_and_non_contiguous_jobs():
    with pytest.raises(PlanError, match="microbatch 0 has 20 tokens, capacity is 15"):
        verify_plan(make_plan([[E("B", 0, "b0"), E("B", 0, "b1")]], cap=15), [JOB_B], 2, 1)
    mixed = [E("B", 0, "b0"), E("A", 0, "a0"), E("B", 0, "b1")]
    a1 = JobSpec("A", [[("a0", 10)]], 1)
    with pytest.raises(PlanError, match="job 'B' are not contiguous"):
        verify_plan(make_plan([mixed]), [a1, JOB_B], 2, 1)


def test_rejects_wrong_last_microbatch_and_layout_and_ready():
    p = make_plan([[E("B", 0, "b0")], [E("B", 0, "b1")]])
    p.last_microbatch["B", 0] = 0
    with pytest.raises(PlanError, match="last_microbatch says 0, but its last microbatch is 1"):
        verify_plan(p, [JOB_B], 2, 1)
    p = make_plan([[E("B", 0, "b0")], [E("B", 0, "b1")], []], dp=2)
    with pytest.raises(PlanError, match="not a multiple of dp_size=2"):
        verify_plan(p, [JOB_B], 2, 2)
    p = make_plan([[E("B", 0, "b0"), E("B", 0, "b1")]], ready={"B": 1})
    with pytest.raises(PlanError, match="before its carried ready slot 1"):
        verify_plan(p, [JOB_B], 2, 1)
    with pytest.raises(PlanError, match="made for S=2"):
        verify_plan(make_plan([[E("B", 0, "b0"), E("B", 0, "b1")]]), [JOB_B], 4, 1)


def test_dp_rule_is_on_slots():
    # dp=2: slot 0 = [A0, noop], slot 1 = [A1, noop] -> distance 1 < S=2
    p = make_plan([[E("A", 0, "a0")], [], [E("A", 1, "a1")], []], S=2, dp=2)
    with pytest.raises(PlanError, match="slot distance >= 2, got 1"):
        verify_plan(p, [JOB_A], 2, 2)
    p = make_plan([[E("A", 0, "a0")], [], [], [], [E("A", 1, "a1")], []], S=2, dp=2)
    verify_plan(p, [JOB_A], 2, 2)


def test_sequence_inserts_only_needed_noops_and_rejects_impossible_streams():
    stream = [PackedMicrobatch((E("A", 0, "a0"),)), PackedMicrobatch((E("A", 1, "a1"),))]
    mbs, last = sequence(stream, 3)
    assert [m.is_noop for m in mbs] == [False, True, True, False]
    assert last == {("A", 0): 0, ("A", 1): 3}
    other = PackedMicrobatch((E("B", 0, "b0"),))
    mbs, _ = sequence(stream + [other], 3)  # B may run in A's gap
    assert [m.is_noop for m in mbs] == [False, False, True, False]
    bad = [PackedMicrobatch((E("A", 0, "a0"), E("A", 1, "a1")))]
    with pytest.raises(PlanError, match="can never become ready"):
        sequence(bad, 2)


# ---------------------------------------------------------------- planner output always verifies

@st.composite
def job_mixes(draw):
    n = draw(st.integers(1, 4))
    jobs = []
    for j in range(n):
        gbs = draw(st.integers(1, 6))
        nb = draw(st.integers(1, 3))
        batches = []
        for g in range(nb):
            size = gbs if g < nb - 1 else draw(st.integers(1, gbs))
            lens = draw(st.lists(st.integers(1, 300), min_size=size, max_size=size))
            batches.append([(f"j{j}g{g}s{i}", n_) for i, n_ in enumerate(lens)])
        jobs.append(JobSpec(f"job{j}", batches, gbs, priority=draw(st.integers(0, 2))))
    return jobs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=job_mixes(),
    S=st.integers(1, 4),
    dp=st.integers(1, 2),
    cap=st.sampled_from([300, 512, 1000]),
    grouping=st.booleans(),
    merge=st.booleans(),
)
def test_planner_output_always_verifies(jobs, S, dp, cap, grouping, merge):
    cfg = SchedulerConfig(S, dp, cap, milp_time_limit_s=0.0, grouping=grouping, merge=merge)
    p = plan(jobs, cfg)
    rep = verify_plan(p, jobs, S, dp)
    # every sample exactly once, independently of verify_plan
    seen = Counter((e.job, e.batch, e.sample_id) for mb in p.microbatches for e in mb.entries)
    want = Counter((j.name, g, sid) for j in jobs for g, b in enumerate(j.global_batches) for sid, _ in b)
    assert seen == want
    assert rep.num_noops == sum(mb.is_noop for mb in p.microbatches)
    assert all(mb.num_tokens <= cap for mb in p.microbatches)


def test_planner_with_milp_verifies_and_grouping_avoids_noops():
    jobs = [
        JobSpec(f"j{k}", [[(f"j{k}-{g}-{i}", 100 + 37 * ((i * 7 + k) % 11)) for i in range(8)]
                          for g in range(3)], 8)
        for k in range(4)
    ]
    grouped = plan(jobs, SchedulerConfig(4, 1, 1024, milp_time_limit_s=0.3))
    single = plan(jobs, SchedulerConfig(4, 1, 1024, milp_time_limit_s=0.3, grouping=False))
    verify_plan(grouped, jobs, 4, 1)
    verify_plan(single, jobs, 4, 1)
    assert len(grouped.stats.groups) >= 2
    assert grouped.num_noops < single.num_noops


@pytest.mark.parametrize("dp", [2, 4])
def test_plan_spreads_small_global_batches_over_dp_ranks(dp):
    """Each job's global batch fits one microbatch (the quickstart at dp>1): every DP rank still gets work
    in every slot that has any, instead of one rank taking everything and the others only no-ops."""
    jobs = [JobSpec(f"j{j}", [[(f"{j}-{g}-{i}", 20 + i) for i in range(8)] for g in range(2)], 8)
            for j in range(3)]
    cfg = SchedulerConfig(pipeline_depth=1, dp_size=dp, token_capacity=1024, milp_time_limit_s=0.1)
    p = plan(jobs, cfg)
    verify_plan(p, jobs, 1, dp)
    for slot in range(p.num_slots):
        row = [mb for mb in p.microbatches if mb.slot == slot]
        if any(not mb.is_noop for mb in row):
            assert all(not mb.is_noop for mb in row), [(mb.dp_rank, mb.num_tokens) for mb in row]
