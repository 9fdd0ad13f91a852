"""policy.py (shortest first, fill of idle slots), the fill stream of ``sequence``/``plan``, and
``OnlineScheduler`` under ``policy="shortest_first"`` (its random join/leave property test, over every policy,
is in test_sched_online.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafusion.scheduler import (
    Entry,
    OnlineScheduler,
    PackedMicrobatch,
    PlanError,
    SchedulerConfig,
    plan,
    sequence,
    verify_plan,
)
from lorafusion.scheduler import policy
from lorafusion.scheduler.replay import SimCost, run_policies

from test_sched_online import make_job


def test_order_is_priority_then_least_remaining_work_then_given_order():
    jobs = [policy.JobWork("long", 0, 900), policy.JobWork("short", 0, 100),
            policy.JobWork("urgent", 1, 5000), policy.JobWork("tie", 0, 100)]
    assert policy.order(jobs) == ["urgent", "short", "tie", "long"]


def test_idle_slots_and_microbatch_estimate():
    assert policy.idle_slots(1, 4, 8) == 0  # no pipeline: nothing idle
    assert policy.idle_slots(4, 1, 1) == 0  # one batch: only the fill/drain every chunk has
    assert policy.idle_slots(4, 2, 3) == 2 * 3 * 2
    assert policy.microbatches_of([100, 200, 5000], 1000) == 2  # 100 + 200 + 1000 (cut) tokens
    assert policy.microbatches_of([1], 1000) == 1


def test_take_fill_draws_whole_batches_in_order_until_the_room_is_used():
    left = {"a": [[900], [900]], "b": [[300, 300], [300]], "c": [[10]]}

    def next_batch(name):
        return left[name].pop(0) if left[name] else None

    # room 3: a's two batches (one microbatch each), then b's first (one microbatch): 3 used, c untouched
    assert policy.take_fill(["a", "b", "c"], next_batch, 1000, 3) == {"a": 2, "b": 1}
    assert left == {"a": [], "b": [[300]], "c": [[10]]}
    assert policy.take_fill(["c"], next_batch, 1000, 0) == {}


def _mbs(job, batch, sizes):
    return [PackedMicrobatch((Entry(job, batch, f"{job}{batch}:{k}", n),)) for k, n in enumerate(sizes)]


def test_fill_stream_takes_only_idle_slots_and_leaves_the_main_stream_in_place():
    S = 3
    main = _mbs("m", 0, [100, 100]) + _mbs("m", 1, [100]) + _mbs("m", 2, [100])
    fill = _mbs("f", 0, [50, 50, 50]) + _mbs("f", 1, [50])
    alone, last_alone = sequence(main, S)
    both, last = sequence(main, S, fill=fill)
    slot_of = lambda mbs, job: [mb.slot for mb in mbs if mb.entries and mb.entries[0].job == job]  # noqa: E731
    assert slot_of(both, "m") == slot_of(alone, "m")  # the main job runs exactly as alone
    idle = {mb.slot for mb in alone if mb.is_noop}
    fill_slots = slot_of(both, "f")
    assert all(s in idle or s > max(slot_of(alone, "m")) for s in fill_slots)
    assert sum(mb.is_noop for mb in both) < sum(mb.is_noop for mb in alone)
    with pytest.raises(PlanError, match="fill stream holds global batches of the main stream"):
        sequence(main, S, fill=_mbs("m", 2, [1]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=st.integers(1, 4), dp=st.integers(1, 2), n_fill=st.integers(0, 3), seed=st.integers(0, 10**6))
def test_plan_with_fill_verifies_and_the_main_jobs_keep_their_slots(S, dp, n_fill, seed):
    rng = random.Random(seed)
    cfg = SchedulerConfig(S, dp, 1024, milp_time_limit_s=0.0)
    main = [make_job("main", rng.randint(1, 6), rng.randint(1, 4), 20, 900, rng.randint(0, 10**6))]
    fill = [make_job(f"f{k}", rng.randint(1, 6), rng.randint(1, 3), 20, 900, rng.randint(0, 10**6))
            for k in range(n_fill)]
    alone = plan(main, cfg)
    both = plan(main, cfg, fill=fill)
    verify_plan(both, main + fill, S, dp)
    where = lambda p: [(mb.slot, mb.entries) for mb in p.microbatches  # noqa: E731
                       if mb.entries and mb.entries[0].job == "main"]
    assert where(both) == where(alone)


def test_shortest_first_trains_the_job_with_least_work_and_fills_its_idle_slots():
    S, rounds = 4, 3
    online = OnlineScheduler(SchedulerConfig(S, 1, 1024, milp_time_limit_s=0.0, policy="shortest_first"))
    online.add_job(make_job("long", 4, 8, 100, 500, 0))
    online.add_job(make_job("short", 4, 3, 100, 500, 1))
    online.add_job(make_job("vip", 4, 6, 100, 500, 2, priority=1))
    first = online.plan_next(rounds)
    jobs_in = lambda p: {e.job for mb in p.microbatches for e in mb.entries}  # noqa: E731
    batches_of = lambda p, j: {e.batch for mb in p.microbatches for e in mb.entries if e.job == j}  # noqa: E731
    assert batches_of(first, "vip") == {0, 1, 2}  # priority first, its whole chunk
    assert jobs_in(first) - {"vip"}  # others filled its idle slots
    fill_mbs = [mb for mb in first.microbatches if mb.entries and mb.entries[0].job != "vip"]
    # the room is used up (the last batch may overshoot)
    assert len(fill_mbs) >= policy.idle_slots(S, 1, rounds)
    assert first.num_noops < plan([online.specs["vip"]],
                                  SchedulerConfig(S, 1, 1024, milp_time_limit_s=0.0)).num_noops
    # "short" filled before "long" (less work left): it has batches in the first chunk, in order
    assert batches_of(first, "short") and min(batches_of(first, "short")) == 0


def test_shortest_first_beats_fifo_mean_jct_when_a_long_job_arrives_first():
    """A long job, then two short ones: FIFO makes them wait behind it; shortest first pre-empts it at a
    chunk boundary, so the mean completion time drops (the replay of the issue's benchmark, in small)."""
    jobs = [make_job("long", 4, 24, 200, 800, 0), make_job("s1", 4, 2, 200, 800, 1),
            make_job("s2", 4, 3, 200, 800, 2)]
    arrival = {"long": 0.0, "s1": 0.01, "s2": 0.02}
    cfg = SchedulerConfig(2, 1, 2048, milp_time_limit_s=0.0, lookahead_batches=2, solver="greedy",
                          policy="shortest_first")
    res = run_policies(jobs, arrival, cfg, SimCost())
    sf, together = res["online_shortest_first"], res["online_together"]
    assert res["online"].finish == sf.finish  # the config's policy
    mean = lambda r: sum(r.jct.values()) / len(r.jct)  # noqa: E731
    assert mean(sf) < 0.6 * mean(res["sequential"])
    assert sf.finish["s1"] < sf.finish["long"] and sf.finish["s2"] < sf.finish["long"]
    assert mean(sf) < mean(together)  # and better than sharing every chunk alike


def test_together_plans_train_every_job_together_whatever_the_configs_policy():
    """The benchmark fits its multi-adapter penalty on these plans: they must mix adapters."""
    from lorafusion.scheduler.replay import together_plans

    jobs = [make_job(n, 4, 2, 100, 400, k) for k, n in enumerate("abc")]
    plans = together_plans(jobs, SchedulerConfig(1, 1, 4096, milp_time_limit_s=0.0, policy="shortest_first"))
    assert len(plans) == 1 and any(len(mb.jobs) > 1 for mb in plans[0].microbatches)


def test_chunk_jobs_per_policy():
    jobs = [policy.JobWork("a", 0, 500), policy.JobWork("b", 0, 100), policy.JobWork("c", 1, 900)]
    assert policy.chunk_jobs("together", jobs) == (["a", "b", "c"], [])
    assert policy.chunk_jobs("fifo", jobs) == (["c"], [])  # priority first, then arrival
    assert policy.chunk_jobs("fifo", jobs[:2]) == (["a"], [])
    assert policy.chunk_jobs("shortest_first", jobs) == (["c"], ["b", "a"])
    assert policy.chunk_jobs("shortest_first", []) == ([], [])
    with pytest.raises(ValueError, match="unknown policy"):
        policy.chunk_jobs("lifo", jobs)


@pytest.mark.parametrize("S", [1, 4])
def test_online_fifo_replays_sequential_fifo(S):
    """``policy="fifo"`` inside one run is today's practice: on one stage it finishes every job exactly when
    sequential FIFO does; on four it is no slower (a chunk runs a job's batches back to back with S - 1 idle
    slots between them instead of a full fill and drain per batch)."""
    jobs = [make_job("a", 4, 5, 200, 800, 0), make_job("b", 8, 2, 200, 800, 1),
            make_job("c", 4, 3, 200, 800, 2)]
    arrival = {"a": 0.0, "b": 0.001, "c": 50.0}
    res = run_policies(jobs, arrival, SchedulerConfig(S, 1, 2048, milp_time_limit_s=0.0, lookahead_batches=2,
                                                      solver="greedy"), SimCost())
    seq, fifo = res["sequential"].finish, res["online_fifo"].finish
    if S == 1:
        assert fifo == pytest.approx(seq, rel=1e-9)
    else:
        assert all(fifo[n] <= seq[n] * (1 + 1e-9) for n in seq)
        assert fifo["c"] == pytest.approx(seq["c"], rel=0.1)
    assert sorted(fifo, key=fifo.get) == ["a", "b", "c"]
