"""simulate.py: closed-form 1F1B bubbles, no-ops as flushes, charts; costmodel.py: fit and auto capacity."""

from __future__ import annotations

import itertools
import random

import pytest

from lorafusion.scheduler import (
    CostModel,
    JobSpec,
    PlanError,
    SchedulerConfig,
    auto_token_capacity,
    bubble_ratio,
    fit_cost_model,
    plan,
    render_gantt,
    render_packing,
    simulate_1f1b,
    simulate_plan,
)


@pytest.mark.parametrize("S,M", [(1, 5), (2, 3), (4, 8), (4, 1), (3, 10)])
def test_uniform_1f1b_matches_closed_form(S, M):
    f = 0.3
    tl = simulate_1f1b([f] * M, S, backward_ratio=2.0)
    per = 3 * f / S
    assert tl.makespan == pytest.approx((M + S - 1) * per)
    assert tl.bubble_ratio == pytest.approx((S - 1) / (M + S - 1))
    assert all(b == pytest.approx(M * per) for b in tl.busy)
    # stage order is 1F1B: each stage's ops never overlap
    for s in range(S):
        ops = sorted((o for o in tl.ops if o.stage == s), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(ops))


def test_p2p_adds_to_the_critical_path():
    base = simulate_1f1b([1.0] * 4, 4).makespan
    slow = simulate_1f1b([1.0] * 4, 4, p2p_s=0.1).makespan
    # at least the first forward's and the last backward's S-1 hops; at most one hop per op
    assert base + 2 * 3 * 0.1 - 1e-9 <= slow <= base + 2 * 4 * 4 * 0.1


@pytest.mark.parametrize("V", [1, 2])
def test_each_op_of_a_model_chunk_adds_its_fixed_work(V):
    """op_s: every forward and backward of a microbatch on a model chunk (no-ops excepted) keeps its rank busy
    op_s longer, so V model chunks cost V times the per-op work of one."""
    S, M, op = 2, 4, 0.05
    base = simulate_1f1b([1.0] * M, S, virtual_stages=V)
    slow = simulate_1f1b([1.0] * M, S, virtual_stages=V, op_s=op)
    assert [b - b0 for b, b0 in zip(slow.busy, base.busy, strict=True)] == pytest.approx([2 * V * M * op] * S)
    assert slow.makespan >= base.makespan + 2 * V * M * op - 1e-9
    noop = simulate_1f1b([1.0] * M, S, virtual_stages=V, op_s=op, noop=[False, True, False, False])
    assert noop.busy == pytest.approx([(M - 1) * (3.0 / S + 2 * V * op)] * S)  # a no-op does no work


def test_noops_make_a_flush_and_lorafusion_beats_single_adapter():
    rng = random.Random(1)
    jobs = [
        JobSpec(f"j{k}", [[(f"{k}-{g}-{i}", rng.randint(200, 900)) for i in range(16)] for g in range(4)], 16)
        for k in range(4)
    ]
    S, cap = 4, 4096
    joint = plan(jobs, SchedulerConfig(S, 1, cap, milp_time_limit_s=0.2))
    bub_joint = bubble_ratio(simulate_plan(joint))
    busy = span = 0.0
    for job in jobs:
        alone = plan([job], SchedulerConfig(S, 1, cap, milp_time_limit_s=0.0, grouping=False))
        assert alone.num_noops >= (S - 1) * (len(job.global_batches) - 1)
        (tl,) = simulate_plan(alone)
        busy, span = busy + sum(tl.busy), span + S * tl.makespan
    assert bub_joint < 1 - busy / span


def test_charts_are_written(tmp_path):
    jobs = [JobSpec(f"j{k}", [[(f"{k}-{i}", 300 + 50 * i) for i in range(8)]], 8) for k in range(3)]
    p = plan(jobs, SchedulerConfig(2, 1, 2048, milp_time_limit_s=0.0))
    (tl,) = simulate_plan(p)
    render_gantt(p, tl, str(tmp_path / "g.png"))
    render_packing(p, str(tmp_path / "p.png"))
    for name in ("g.png", "p.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_fit_recovers_coefficients():
    truth = CostModel(a=2e-3, b=5e-6, c=3e-10, gamma=0.0)
    rng = random.Random(0)
    obs = []
    for _ in range(60):
        lens = [rng.randint(50, 4000) for _ in range(rng.randint(1, 8))]
        t = truth.microbatch_time(lens) * (1 + rng.uniform(-0.01, 0.01))
        obs.append((lens, t))
    fit = fit_cost_model(obs)
    assert fit.a == pytest.approx(truth.a, rel=0.2)
    assert fit.b == pytest.approx(truth.b, rel=0.05)
    assert fit.c == pytest.approx(truth.c, rel=0.2)


def test_fit_is_non_negative():
    # time independent of length squared, and slightly decreasing noise would give c < 0 in plain lstsq
    obs = [([n], 1e-3 + 1e-6 * n - 1e-13 * n * n) for n in (100, 1000, 2000, 3000, 4000)]
    fit = fit_cost_model(obs)
    assert fit.a >= 0 and fit.b > 0 and fit.c == 0.0


def test_auto_capacity_rule():
    cm = CostModel(a=1e-3, b=4e-6, c=0.0)
    cap = auto_token_capacity(cm, max_sample_len=1000, overhead_frac=0.05)
    # a <= 0.05 (a + b C)  <=>  C >= a * 0.95 / (0.05 b) = 4750 -> next multiple of 512
    assert cap == 5120
    assert cm.a <= 0.05 * (cm.a + cm.b * cap)
    assert auto_token_capacity(cm, max_sample_len=9000) == 9216
    assert auto_token_capacity(cm, 100, max_capacity=2048) == 2048
    # a run's auto: lorafusion.resolve
    with pytest.raises(PlanError, match="token_capacity must be a positive int"):
        SchedulerConfig(token_capacity="auto")
