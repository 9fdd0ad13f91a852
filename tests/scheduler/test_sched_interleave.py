"""Interleaved 1F1B (virtual stages): Megatron's op order, the dependency rule it implies, planner, verify,
simulator. The rule is checked against the op order by brute force and against simulated timelines."""

from __future__ import annotations

import random

import pytest

from lorafusion.scheduler import JobSpec, Microbatch, Plan, PlanError, SchedulerConfig, plan, verify_plan
from lorafusion.scheduler.pipeorder import (
    dependency_distance,
    interleave_padding,
    schedule_table,
    stage_order,
    start_slot,
    warmup,
)
from lorafusion.scheduler.simulate import simulate_1f1b, simulate_plan

CASES = [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)]


@pytest.mark.parametrize("S,V", CASES)
def test_order_is_megatrons(S, V):
    """Table and warm-up counts equal megatron-core's own functions (the order the runtime runs)."""
    sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    m = 3 * S
    assert schedule_table(m, V, S) == sched.get_schedule_table(m, V, S)

    class Group:
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return S

        def rank(self):
            return self._rank

    class Comm:
        virtual_pipeline_model_parallel_size = V

        def __init__(self, rank):
            self.pp_group = Group(rank)

    for r in range(S):
        total, _, warm, _ = sched.get_pp_rank_microbatches(m, V, S, p2p_communicator=Comm(r))
        order = stage_order(S, r, m, V)
        assert len(order) == 2 * total and warm == min(total, warmup(S, r, V))
        assert [op for op in order[:warm]] == [("F", u, c) for u, c in schedule_table(m, V, S)[:warm]]


@pytest.mark.parametrize("S,V", [(1, 1), (2, 1), (4, 1), *CASES])
def test_start_slot_is_exact_on_every_rank(S, V):
    """start_slot(L) is the first u whose chunk-0 forward follows chunk 0's backward of L on every rank."""
    m = 6 * S
    pos = []
    for r in range(S):
        order = stage_order(S, r, m, V)
        pos.append({(k, u): i for i, (k, u, c) in enumerate(order) if c == 0})
    for last in range(m):
        ok = [u for u in range(last + 1, m) if all(p["B", last] < p["F", u] for p in pos)]
        if not ok:
            continue
        # chunk 0's forwards after B(L) are a suffix: start_slot is its first element
        assert ok == list(range(ok[0], m)), (last, ok)
        assert start_slot(last, S, V) == ok[0], (last, ok[0])
    if V == 1:
        assert dependency_distance(S, V) == S
    else:
        assert dependency_distance(S, V) > S  # interleaving needs a longer gap between a job's batches


def _jobs(seed, n_jobs=4, batches=4):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(n_jobs)]
    return [JobSpec(f"j{k}", [[(f"j{k}-{g}-{i}", rng.randint(50, 900)) for i in range(sizes[k])]
                              for g in range(batches)], sizes[k]) for k in range(n_jobs)]


@pytest.mark.parametrize("S,V,dp", [(2, 2, 1), (4, 2, 1), (4, 2, 2), (3, 3, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_interleaved_plans_verify_and_hold_in_simulation(S, V, dp, seed):
    """Planner output for V > 1 passes verify (padded to a multiple of S) and, independently of the formula,
    the simulated timeline never starts a job's next batch on any rank before its last backward there
    ended."""
    jobs = _jobs(seed, n_jobs=1 + seed)
    cfg = SchedulerConfig(pipeline_depth=S, dp_size=dp, token_capacity=1024, milp_time_limit_s=0.05,
                          virtual_stages=V, solver="greedy")
    p = plan(jobs, cfg)
    assert p.virtual_stages == V and p.num_slots % S == 0
    verify_plan(p, jobs, S, dp, virtual_stages=V)
    first, last = {}, {}
    for mb in p.microbatches:
        for e in mb.entries:
            first.setdefault((e.job, e.batch), mb.slot)
            last[e.job, e.batch] = mb.slot
    for r in range(dp):
        mbs = p.for_rank(r)
        tl = simulate_1f1b([1.0 + 0.3 * (k % 5) for k in range(len(mbs))], S, p2p_s=0.01,
                           noop=[mb.is_noop for mb in mbs], virtual_stages=V)
        for (job, g), end_slot in last.items():
            if (job, g + 1) in first:
                for s in range(S):
                    assert tl.op(s, end_slot, "B", 0).end <= tl.op(s, first[job, g + 1], "F", 0).start


def test_verify_refuses_a_1f1b_gap_under_interleaving():
    """A plan whose batches are S slots apart is fine for 1F1B and refused for V = 2, naming the rule."""
    S = 4
    job = JobSpec("A", [[("a0", 10)], [("a1", 10)]], 1)
    slots = [[("A", 0, "a0")], [], [], [], [("A", 1, "a1")], [], [], []]
    from lorafusion.scheduler import Entry

    def make(V):
        mbs = [Microbatch(k, k, 0, tuple(Entry(*e, 10) for e in es), is_noop=not es)
               for k, es in enumerate(slots)]
        return Plan(mbs, S, 1, 100, {("A", 0): 0, ("A", 1): 4}, virtual_stages=V)

    verify_plan(make(1), [job], S, 1)
    with pytest.raises(PlanError, match=r"interleaved 1F1B with S=4, V=2 needs a slot distance >= 8, got 4"):
        verify_plan(make(2), [job], S, 1, virtual_stages=2)
    with pytest.raises(PlanError, match="made for S=4, dp=1, V=2; verifying for S=4, dp=1, V=1"):
        verify_plan(make(2), [job], S, 1)
    short = make(2)
    short.microbatches[:] = short.microbatches[:6]
    with pytest.raises(PlanError, match="runs a multiple of pp microbatches per rank"):
        verify_plan(short, [job], S, 1, virtual_stages=2)


def test_bad_virtual_stages_one_clear_error():
    with pytest.raises(PlanError, match="virtual_stages: 2 needs a pipeline"):
        SchedulerConfig(pipeline_depth=1, virtual_stages=2)
    assert (interleave_padding(5, 4, 2) == 3 and interleave_padding(2, 4, 2) == 2
            and interleave_padding(5, 4, 1) == 0)


def test_interleaving_shrinks_fill_and_drain():
    """Equal microbatches, equal stages: the bubble of interleaved 1F1B is about (S-1)/(V·m + S-1)."""
    S, m = 4, 16
    one = simulate_1f1b([1.0] * m, S).bubble_ratio
    two = simulate_1f1b([1.0] * m, S, virtual_stages=2).bubble_ratio
    assert one == pytest.approx((S - 1) / (m + S - 1), rel=1e-6)
    assert two < 0.6 * one


def test_simulate_plan_uses_stage_costs():
    """A heavier last virtual stage (the output layer and loss) makes the last rank the busiest."""
    jobs = _jobs(0, n_jobs=2)
    cfg = SchedulerConfig(pipeline_depth=2, token_capacity=1024, virtual_stages=2, solver="greedy")
    p = plan(jobs, cfg)
    costs = [(0.2, 0.4), (0.2, 0.4), (0.2, 0.4), (0.4, 0.8)]
    (tl,) = simulate_plan(p, stage_costs=costs)
    assert tl.busy[1] == pytest.approx(1.5 * tl.busy[0])
    with pytest.raises(ValueError, match="stage_costs: expected 4"):
        simulate_plan(p, stage_costs=costs[:3])
