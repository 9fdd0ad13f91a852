"""The in-pipeline optimizer steps of interleaved 1F1B (runtime/pipeline.py InterleavedStepTracker), driven by
Megatron's op order without a model: every step begins after the batch's last backward on the rank and ends
before the job's next forward there, once each, in order; a plan that breaks the rule is an error."""

from __future__ import annotations

import pytest

from lorafusion.runtime.pipeline import InterleavedStepTracker
from lorafusion.scheduler import Entry, JobSpec, Microbatch, Plan, SchedulerConfig, plan, stage_order


class _Opt:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def begin_step(self):
        self.log.append(("begin", self.name))

    def end_step(self):
        self.log.append(("end", self.name))
        return (0.0, 1e-3)


def _drive(p: Plan, stage: int, S: int, V: int):
    """Run rank ``stage``'s ops in order; returns the event log with ("F"/"B", microbatch, chunk) marks."""
    log: list = []
    jobs = {e.job for mb in p.microbatches for e in mb.entries}
    tracker = InterleavedStepTracker(p, {j: _Opt(j, log) for j in jobs}, stage, S, V, p.num_slots)
    mbs = p.for_rank(0)
    for kind, u, c in stage_order(S, stage, p.num_slots, V):
        if kind == "F":  # the hook runs before the forward, the other after the backward
            tracker.before_forward({e.job: e.batch for e in mbs[u].entries}, c)
            log.append((kind, u, c))
        else:
            log.append((kind, u, c))
            tracker.after_backward()
    tracker.finish()
    return log


@pytest.mark.parametrize("S,V", [(2, 2), (4, 2), (3, 3)])
def test_steps_begin_after_the_last_backward_and_end_before_the_next_forward(S, V):
    jobs = [JobSpec(f"j{k}", [[(f"{k}-{g}-{i}", 40 + 30 * ((k + g + i) % 5)) for i in range(2 + k)]
                              for g in range(3)], 2 + k) for k in range(3)]
    p = plan(jobs, SchedulerConfig(pipeline_depth=S, token_capacity=200, virtual_stages=V, solver="greedy"))
    first, last = {}, {}
    for mb in p.microbatches:
        for e in mb.entries:
            first.setdefault((e.job, e.batch), mb.slot)
            last[e.job, e.batch] = mb.slot
    for stage in range(S):
        log = _drive(p, stage, S, V)
        pos = {ev: i for i, ev in enumerate(log) if ev[0] in "FB"}
        for job in {j for j, _ in last}:
            events = [ev[0] for ev in log if ev[0] in ("begin", "end") and ev[1] == job]
            n = sum(1 for j, _ in last if j == job)
            assert events == ["begin", "end"] * n  # one step per batch, in order
            begins = [i for i, ev in enumerate(log) if ev == ("begin", job)]
            ends = [i for i, ev in enumerate(log) if ev == ("end", job)]
            for g in range(n):
                assert begins[g] > pos["B", last[job, g], 0]  # after every backward of batch g here
                if (job, g + 1) in first:
                    assert ends[g] < pos["F", first[job, g + 1], 0]  # updated before batch g+1 runs here


def test_a_plan_that_breaks_the_rule_is_an_error():
    """Batches S slots apart are fine for 1F1B; under interleaving the tracker refuses to run batch 1 on stale
    adapters (the verifier refuses such a plan first: tests/scheduler/test_sched_interleave.py)."""
    S = 4
    slots = [[Entry("A", 0, "a0", 10)], [], [], [], [Entry("A", 1, "a1", 10)], [], [], []]
    mbs = [Microbatch(k, k, 0, tuple(es), is_noop=not es) for k, es in enumerate(slots)]
    p = Plan(mbs, S, 1, 100, {("A", 0): 0, ("A", 1): 4}, virtual_stages=2)
    with pytest.raises(RuntimeError,
                       match="dependency rule broken: job 'A' batch 1 reaches chunk 0 before batch 0"):
        _drive(p, 0, S, 2)
