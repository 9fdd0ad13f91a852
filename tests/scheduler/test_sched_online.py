"""online.py (jobs join/leave, order kept), grouper.py (stagger rule), merge.py, balance modes."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafusion.scheduler import (
    AdapterGrouper,
    DataBatcher,
    Entry,
    JobLoad,
    JobSpec,
    OnlineScheduler,
    PackedMicrobatch,
    PlanError,
    SchedulerConfig,
    concat_plans,
    pack_objective,
    plan,
    verify_plan,
)
from lorafusion.scheduler.grouper import stagger_ok
from lorafusion.scheduler.merge import fill_pair
from lorafusion.scheduler.policy import POLICIES


def make_job(name, gbs, nb, lo, hi, seed, **kw):
    rng = random.Random(seed)
    batches = [[(f"{name}:{g}:{i}", rng.randint(lo, hi)) for i in range(gbs)] for g in range(nb)]
    return JobSpec(name, batches, gbs, **kw)


def job_order(p, job):
    """(batch, sample_id) of ``job`` in plan order."""
    return [(e.batch, e.sample_id) for mb in p.microbatches for e in mb.entries if e.job == job]


def test_join_and_leave_keep_sample_and_step_order():
    S = 3
    cfg = SchedulerConfig(S, 1, 2048, milp_time_limit_s=0.05)
    online = OnlineScheduler(cfg)
    a = make_job("A", 8, 6, 100, 700, 0)
    b = make_job("B", 4, 6, 300, 1500, 1, rank=64)
    c = make_job("C", 16, 3, 50, 400, 2, priority=5)
    online.add_job(a)
    online.add_job(b)
    snapshots = []
    for _ in range(2):
        online.plan_next(1)
        snapshots.append(copy.deepcopy(online.plans))
    online.add_job(c)
    online.plan_next(1)
    snapshots.append(copy.deepcopy(online.plans))
    online.remove_job("A")
    with pytest.raises(PlanError, match="not running"):
        online.remove_job("A")
    while online.plan_next(1) is not None:
        pass
    # finished work is never rewritten
    for snap in snapshots:
        assert online.plans[: len(snap)] == snap
    combined = online.combined()
    planned = {j.name: j for j in online.planned_jobs()}
    assert len(planned["A"].global_batches) == 3 and len(planned["B"].global_batches) == 6
    assert len(planned["C"].global_batches) == 3
    report = verify_plan(combined, list(planned.values()), S, 1)
    assert report.num_samples == sum(len(b) for j in planned.values() for b in j.global_batches)
    for name, job in planned.items():
        seen = job_order(combined, name)
        batches = [g for g, _ in seen]
        assert batches == sorted(batches), f"{name}: batches out of order"
        for g, gb in enumerate(job.global_batches):
            assert {sid for bb, sid in seen if bb == g} == {sid for sid, _ in gb}
        steps = [combined.step_slot(name, g) for g in range(len(job.global_batches))]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
    rep = online.report()
    assert set(rep) == {"A", "B", "C"}
    for r in rep.values():
        assert r.alone_s > 0 and r.shared_s > 0 and r.slowdown == pytest.approx(r.shared_s / r.alone_s)
        assert list(r.step_slots) == sorted(r.step_slots)


def test_online_carry_prevents_violation_across_plans():
    """A lone job planned round by round must still wait S slots between its batches."""
    S = 4
    online = OnlineScheduler(SchedulerConfig(S, 1, 4096, milp_time_limit_s=0.0))
    job = make_job("solo", 4, 3, 100, 300, 3)
    online.add_job(job)
    while online.plan_next(1) is not None:
        pass
    assert [p.initial_ready.get("solo", 0) for p in online.plans][1:] == [S - 1, S - 1]
    verify_plan(online.combined(), online.planned_jobs(), S, 1)
    # dropping the carry makes the concatenation invalid: verify must notice
    broken = [copy.deepcopy(p) for p in online.plans]
    broken[1].microbatches[:] = [mb for mb in broken[1].microbatches if not mb.is_noop]
    broken[1].microbatches[:] = [
        type(mb)(k, k, 0, mb.entries, mb.is_noop, mb.group) for k, mb in enumerate(broken[1].microbatches)
    ]
    broken[1].last_microbatch = {key: len(broken[1].microbatches) - 1 for key in broken[1].last_microbatch}
    with pytest.raises(PlanError, match="dependency violated: job 'solo' batch 1"):
        verify_plan(concat_plans(broken), online.planned_jobs(), S, 1)


def test_priority_orders_jobs_inside_microbatches():
    lo = make_job("low", 4, 1, 100, 200, 4)
    hi = make_job("high", 4, 1, 100, 200, 5, priority=3)
    p = plan([lo, hi], SchedulerConfig(1, 1, 4096, milp_time_limit_s=0.0))
    verify_plan(p, [lo, hi], 1, 1)
    for mb in p.microbatches:
        if len(mb.jobs) == 2:
            assert mb.jobs == ("high", "low")
            assert [s[0] for s in mb.segments()] == ["high", "low"]


def test_grouper_meets_stagger_rule_and_balances():
    loads = [JobLoad("a", 6.0), JobLoad("b", 1.2), JobLoad("c", 1.1), JobLoad("d", 3.5)]
    groups = AdapterGrouper(4).group(loads)
    assert len(groups) >= 2
    by_name = {j.name: j for j in loads}
    assert stagger_ok([[by_name[n] for n in g] for g in groups], 4, 1)
    assert AdapterGrouper(4, enabled=False).group(loads) == [["a", "b", "c", "d"]]
    assert AdapterGrouper(1).group(loads) == [["a", "b", "c", "d"]]
    # impossible to stagger: every job alone (largest stagger)
    tiny = [JobLoad("x", 0.2), JobLoad("y", 0.2)]
    assert sorted(AdapterGrouper(8).group(tiny)) == [["x"], ["y"]]
    assert not stagger_ok([[tiny[0]], [tiny[1]]], 8, 1)


def test_fill_pair_moves_without_mixing_batches_of_one_job():
    a = PackedMicrobatch((Entry("A", 0, "a0", 60),))
    b = PackedMicrobatch((Entry("A", 1, "a1", 10), Entry("B", 0, "b0", 30), Entry("B", 0, "b1", 20)))
    new_a, new_b = fill_pair(a, b, 100, {"A": 0, "B": 1})
    assert [e.sample_id for e in new_a.entries] == ["a0", "b0"]  # a1 conflicts, b1 does not fit
    assert [e.sample_id for e in new_b.entries] == ["a1", "b1"]


def test_even_balance_mode():
    rng = random.Random(7)
    w = [rng.randint(200, 3000) for _ in range(40)]
    fill = DataBatcher(16384, 0.3, balance="fill").pack(w)
    even = DataBatcher(16384, 0.3, balance="even").pack(w)
    assert even.num_bins == fill.num_bins
    assert max(even.loads) - min(even.loads) <= max(fill.loads) - min(fill.loads)
    assert pack_objective(even.loads, "even") <= pack_objective(fill.loads, "even")
    jobs = [make_job(f"j{k}", 16, 2, 200, 3000, k) for k in range(3)]
    p = plan(jobs, SchedulerConfig(2, 2, 8192, milp_time_limit_s=0.1, balance="even"))
    verify_plan(p, jobs, 2, 2)
    with pytest.raises(PlanError, match="balance"):
        SchedulerConfig(balance="tight")


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(st.sampled_from(["plan", "plan", "add", "remove"]), min_size=1, max_size=10),
    S=st.integers(1, 4),
    dp=st.integers(1, 2),
    rounds=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_random_join_leave_sequences_verify_and_keep_order(policy, events, S, dp, rounds, seed):
    """Under every chunk policy (scheduler/policy.py): plans already returned never change, the concatenated
    stream verifies, every job's batches keep their order and steps."""
    rng = random.Random(seed)
    online = OnlineScheduler(SchedulerConfig(S, dp, 1024, milp_time_limit_s=0.0, policy=policy))
    made = 0

    def new_job():
        nonlocal made
        made += 1
        gbs = rng.randint(1, 6)
        return make_job(f"j{made}", gbs, rng.randint(1, 4), 20, 600, rng.randint(0, 10**6),
                        priority=rng.randint(0, 2), rank=rng.choice([8, 16, 64]))

    online.add_job(new_job())
    for ev in events:
        if ev == "add":
            online.add_job(new_job())
        elif ev == "remove" and online.active:
            online.remove_job(rng.choice(online.active))
        else:
            before = copy.deepcopy(online.plans)
            online.plan_next(rounds)
            assert online.plans[: len(before)] == before
    if not online.plans:
        return
    combined = online.combined()
    planned = online.planned_jobs()
    verify_plan(combined, planned, S, dp)
    for job in planned:
        batches = [g for g, _ in job_order(combined, job.name)]
        assert batches == sorted(batches)
        steps = [combined.step_slot(job.name, g) for g in range(len(job.global_batches))]
        assert all(b - a >= S for a, b in itertools.pairwise(steps))
