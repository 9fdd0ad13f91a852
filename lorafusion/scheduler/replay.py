"""Replay an arrival trace in the 1F1B simulator under three policies (torch-free).

* ``sequential``: FIFO, one job at a time in arrival order; each job alone, one 1F1B schedule per global
  batch (a pipeline flush before every optimizer step: Megatron's loop, today's practice).
  With a setup time, each job its own run that first pays it (``separate`` in :mod:`scripts/bench_online`).
* ``static``: wait until every job of the trace has arrived, then train them all together.
* ``online``: a job joins the shared run at the next chunk boundary after it arrives; a finished job
  leaves; every chunk is planned by :class:`OnlineScheduler` under the config's chunk policy
  (:mod:`.policy`: ``together``, ``rounds`` global batches of each active job, the grouper regrouping
  whenever the set of jobs changes; or ``shortest_first``, the job with the least work left and fill)
  and run as one 1F1B schedule (the pipeline fills and drains once per chunk, as the runtime does).

Time comes from :class:`SimCost`: the cost model's whole-model forward time per microbatch, times
``mixed_penalty`` when the microbatch holds more than one adapter (the multi-adapter kernel overhead),
backward = ``backward_ratio`` × forward, ``p2p_s`` per stage hand-over. A job's completion time is the
end of its last backward on stage 0; JCT = completion − arrival. GPU busy fraction = Σ stage compute
time / (stages × makespan), makespan from t = 0 to the last completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .costmodel import CostModel
from .online import OnlineScheduler
from .planner import plan as make_plan
from .policy import POLICIES
from .simulate import Timeline, job_spans, simulate_1f1b
from .spec import JobSpec, Plan, PlanError, SchedulerConfig


@dataclass(frozen=True)
class SimCost:
    model: CostModel = field(default_factory=CostModel)
    mixed_penalty: float = 1.0
    backward_ratio: float = 2.0
    p2p_s: float = 2.0e-4

    def scaled(self, k: float) -> SimCost:
        m = self.model
        return replace(self, model=replace(m, a=m.a * k, b=m.b * k, c=m.c * k))

    def simulate(self, plan: Plan, ranks: Mapping[str, int]) -> Timeline:
        if plan.dp_size != 1:
            raise PlanError("replay simulates dp_size 1 only")
        times, noop = [], []
        for mb in plan.microbatches:
            t = self.model.microbatch_time([e.num_tokens for e in mb.entries],
                                           [ranks[e.job] for e in mb.entries])
            times.append(t * (self.mixed_penalty if len(mb.jobs) > 1 else 1.0))
            noop.append(mb.is_noop)
        return simulate_1f1b(times, plan.pipeline_depth, self.backward_ratio, self.p2p_s, noop,
                             plan.virtual_stages)


@dataclass
class PolicyResult:
    policy: str
    arrival: dict[str, float]
    finish: dict[str, float]
    busy_s: float  # Σ over stages of compute seconds
    stages: int
    tokens: int
    chunks: int = 0

    @property
    def jct(self) -> dict[str, float]:
        return {n: self.finish[n] - self.arrival[n] for n in self.finish}

    @property
    def makespan(self) -> float:
        return max(self.finish.values())

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / (self.stages * self.makespan) if self.makespan > 0 else 0.0

    def summary(self) -> dict:
        j = np.array(list(self.jct.values()))
        return {"mean_jct_s": float(j.mean()), "p90_jct_s": float(np.percentile(j, 90)),
                "makespan_s": self.makespan, "gpu_busy_fraction": self.busy_fraction,
                "tokens": self.tokens, "chunks": self.chunks,
                "jct_s": {n: round(v, 3) for n, v in self.jct.items()}}


def _tokens(jobs: Sequence[JobSpec], capacity: int) -> int:
    return sum(min(n, capacity) if j.truncate else n for j in jobs for b in j.global_batches for _, n in b)


def _ranks(jobs: Sequence[JobSpec]) -> dict[str, int]:
    return {j.name: j.rank for j in jobs}


_ALONE_PLANS: dict[tuple, Plan] = {}  # plans do not depend on the cost: kept across loads and fits


def alone_plan(job: JobSpec, k: int, config: SchedulerConfig) -> Plan:
    """The plan of ``job``'s k-th global batch alone (grouping off); cached per (job, batch, config)."""
    batch = job.global_batches[k]
    key = (job.name, job.first_batch_index + k, tuple(batch), job.truncate, config)
    if key not in _ALONE_PLANS:
        one = replace(job, global_batches=[batch], first_batch_index=job.first_batch_index + k)
        _ALONE_PLANS[key] = make_plan([one], replace(config, grouping=False))
    return _ALONE_PLANS[key]


def alone_batches(job: JobSpec, config: SchedulerConfig, cost: SimCost) -> list[tuple[float, float]]:
    """(duration, busy seconds) of each global batch of ``job`` run alone, one 1F1B schedule per batch."""
    out = []
    for k in range(len(job.global_batches)):
        tl = cost.simulate(alone_plan(job, k, config), _ranks([job]))
        out.append((tl.makespan, sum(tl.busy)))
    return out


def alone_times(jobs: Sequence[JobSpec], config: SchedulerConfig, cost: SimCost) -> dict[str, float]:
    """Each job's time alone on the machine (its global batches back to back, a flush after each)."""
    return {j.name: sum(d for d, _ in alone_batches(j, config, cost)) for j in jobs}


def sequential(jobs: Sequence[JobSpec], arrival: Mapping[str, float], config: SchedulerConfig,
               cost: SimCost, setup_s: float = 0.0) -> PolicyResult:
    """FIFO in arrival order (ties: list order), each job alone, a flush per global batch. ``setup_s``: each
    job is its own run and first pays that long with the GPU idle (process start, model build,
    compilation)."""
    order = sorted(range(len(jobs)), key=lambda k: (arrival[jobs[k].name], k))
    t, busy, finish = 0.0, 0.0, {}
    for k in order:
        job = jobs[k]
        t = max(t, arrival[job.name]) + setup_s
        for dur, b in alone_batches(job, config, cost):
            t += dur
            busy += b
        finish[job.name] = t
    return PolicyResult("sequential", dict(arrival), finish, busy, config.pipeline_depth,
                        _tokens(jobs, int(config.token_capacity)), len(jobs))


def shared(jobs: Sequence[JobSpec], arrival: Mapping[str, float], config: SchedulerConfig, cost: SimCost,
           rounds: int | None = None, static: bool = False,
           on_chunk: Callable[[float, Plan, Timeline], None] | None = None) -> PolicyResult:
    """Online (``static=False``) or static batching (all jobs join once the last has arrived).

    Each chunk plans ``rounds`` (default ``config.lookahead_batches``) global batches of every active job
    and runs as one 1F1B schedule; jobs that arrived by a chunk's start join it.
    """
    rounds = rounds or config.lookahead_batches
    sched = OnlineScheduler(replace(config, token_capacity=int(config.token_capacity)))
    ranks = _ranks(jobs)
    pending = sorted(range(len(jobs)), key=lambda k: (arrival[jobs[k].name], k))
    if static:
        t0 = max(arrival.values())
        pending_at = {jobs[k].name: t0 for k in pending}
    else:
        pending_at = {j.name: arrival[j.name] for j in jobs}
    t, busy, finish, chunks = 0.0, 0.0, {}, 0
    left = {j.name: len(j.global_batches) for j in jobs}
    while pending or sched.active:
        if not sched.active and pending:
            t = max(t, pending_at[jobs[pending[0]].name])
        while pending and pending_at[jobs[pending[0]].name] <= t:
            sched.add_job(jobs[pending.pop(0)])
        p = sched.plan_next(rounds)
        if p is None:  # pragma: no cover - active jobs always have batches left
            raise PlanError("online replay: active jobs with nothing to plan")
        tl = cost.simulate(p, ranks)
        if on_chunk:
            on_chunk(t, p, tl)
        for (job, _), idx in p.last_microbatch.items():
            left[job] -= 1
        spans = job_spans(p, tl)
        for job, (_, end) in spans.items():
            if left[job] == 0 and job not in finish:
                finish[job] = t + end
        t += tl.makespan
        busy += sum(tl.busy)
        chunks += 1
    return PolicyResult("static" if static else "online", dict(arrival), finish, busy, config.pipeline_depth,
                        _tokens(jobs, int(config.token_capacity)), chunks)


def run_policies(jobs: Sequence[JobSpec], arrival: Mapping[str, float], config: SchedulerConfig,
                 cost: SimCost, rounds: int | None = None) -> dict[str, PolicyResult]:
    """Sequential FIFO, static batching (every job each chunk), online under ``config.policy``; and
    ``online_together`` / ``online_shortest_first``: online under each chunk policy."""
    out = {"sequential": sequential(jobs, arrival, config, cost),
           "static": shared(jobs, arrival, replace(config, policy="together"), cost, rounds, static=True)}
    for name in POLICIES:
        res = shared(jobs, arrival, replace(config, policy=name), cost, rounds)
        out[f"online_{name}"] = replace(res, policy=f"online_{name}")
    out["online"] = replace(out[f"online_{config.policy}"], policy="online")
    return out


def srpt_jct(service: Mapping[str, float], arrival: Mapping[str, float]) -> dict[str, float]:
    """Each job's completion time minus arrival under preemptive shortest-remaining-processing-time on one
    server, job ``j`` needing ``service[j]`` seconds of it (ties: earlier arrival, then name).

    With ``service`` = the jobs' times alone this is the ordering-only ceiling: SRPT minimises mean JCT over
    every schedule of one server (Schrage 1968), so no policy beats it without more throughput than the jobs
    get alone (sharing that fills idle capacity) or preemption for free; it ignores chunk granularity."""
    left = dict(service)
    t, done = 0.0, {}
    pending = sorted(left, key=lambda j: (arrival[j], j))
    while pending:
        ready = [j for j in pending if arrival[j] <= t]
        if not ready:
            t = arrival[pending[0]]
            continue
        j = min(ready, key=lambda n: (left[n], arrival[n], n))
        nxt = min((arrival[n] for n in pending if arrival[n] > t), default=float("inf"))
        run = min(left[j], nxt - t)
        t += run
        left[j] -= run
        if left[j] <= 1e-12:
            done[j] = t - arrival[j]
            pending.remove(j)
    return done


def together_plans(jobs: Sequence[JobSpec], config: SchedulerConfig, rounds: int | None = None) -> list[Plan]:
    """The chunk plans of ``jobs`` all present at t = 0 and trained together (policy "together", whatever
    ``config.policy`` says; independent of the cost)."""
    plans: list[Plan] = []
    shared(jobs, {j.name: 0.0 for j in jobs}, replace(config, policy="together"), SimCost(), rounds,
           on_chunk=lambda t, p, tl: plans.append(p))
    return plans


def throughput(jobs: Sequence[JobSpec], config: SchedulerConfig, cost: SimCost,
               plans: Sequence[Plan] | None = None) -> float:
    """Simulated tokens/s of ``jobs`` all present at t = 0: one at a time (``plans`` None, a flush per
    global batch) or the given chunk plans back to back (from :func:`together_plans`)."""
    if plans is None:
        r = sequential(jobs, {j.name: 0.0 for j in jobs}, config, cost)
        return r.tokens / r.makespan
    ranks = _ranks(jobs)
    return _tokens(jobs, int(config.token_capacity)) / sum(cost.simulate(p, ranks).makespan for p in plans)


def bisect(f: Callable[[float], float], target: float, lo: float, hi: float, tol: float = 1e-6) -> float:
    """x in [lo, hi] with f(x) == target for a monotone f (either direction)."""
    up = f(hi) > f(lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) < target) == up:
            lo = mid
        else:
            hi = mid
        if hi - lo < tol * max(1.0, abs(mid)):
            break
    return (lo + hi) / 2


def fit_scale(target_tps: float, tps_of: Callable[[SimCost], float], cost: SimCost) -> SimCost:
    """``cost`` with a, b, c scaled by one factor k such that ``tps_of(cost) == target_tps``."""
    x = bisect(lambda lk: tps_of(cost.scaled(float(np.exp(lk)))), target_tps, -12.0, 12.0)
    return cost.scaled(float(np.exp(x)))
