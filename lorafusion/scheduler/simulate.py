"""1F1B pipeline simulator: per-stage timeline, bubble ratio (the charts of a plan: :mod:`.charts`).

Model: S equal stages; a microbatch whose whole-model forward takes f seconds (from a
:class:`~.costmodel.CostModel`) takes f/S forward and ``backward_ratio``·f/S backward on every stage;
each activation/gradient hand-over between stages adds ``p2p_s``. Every stage runs its ops in 1F1B
order (``S-1-s`` warm-up forwards, alternate, drain); an op starts when its stage is free and its
input has arrived. No-op microbatches take no time and send nothing, so they only delay through the
op order — which is exactly how they realise the dependency rule. Bubble ratio =
1 − Σ busy / (S · makespan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .costmodel import CostModel
from .spec import Plan


@dataclass(frozen=True)
class Op:
    stage: int
    slot: int
    kind: str  # "F" or "B"
    start: float
    end: float


@dataclass
class Timeline:
    """Scheduled ops of one DP rank; ``busy[s]`` is stage s's compute time."""

    num_stages: int
    ops: list[Op] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    makespan: float = 0.0

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)

    def op(self, stage: int, slot: int, kind: str) -> Op:
        return self._index[stage, slot, kind]

    def __post_init__(self) -> None:
        self._index = {(o.stage, o.slot, o.kind): o for o in self.ops}


def one_f_one_b_order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The op order of ``stage`` in 1F1B: warm-up forwards, steady F/B pairs, drain backwards."""
    warm = min(num_stages - 1 - stage, num_microbatches)
    order = [("F", i) for i in range(warm)]
    for i in range(num_microbatches - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warm, num_microbatches)]
    return order


def simulate_1f1b(
    forward_s: Sequence[float],
    num_stages: int,
    backward_ratio: float = 2.0,
    p2p_s: float = 0.0,
    noop: Sequence[bool] | None = None,
) -> Timeline:
    """Simulate one rank; ``forward_s[t]`` is slot t's whole-model forward time."""
    m, S = len(forward_s), num_stages
    noop = list(noop) if noop is not None else [False] * m
    dur = {"F": [f / S for f in forward_s], "B": [backward_ratio * f / S for f in forward_s]}
    orders = [one_f_one_b_order(S, s, m) for s in range(S)]
    pos, free = [0] * S, [0.0] * S
    end: dict[tuple[int, int, str], float] = {}
    ops: list[Op] = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dep = (s - 1, i, "F") if kind == "F" else (s + 1, i, "B")
                if kind == "F" and s == 0:
                    ready = 0.0
                elif kind == "B" and s == S - 1:
                    ready = end[s, i, "F"]
                elif dep in end:
                    ready = end[dep] + (0.0 if noop[i] else p2p_s)
                else:
                    break
                start = max(free[s], ready)
                finish = start + (0.0 if noop[i] else dur[kind][i])
                end[s, i, kind] = free[s] = finish
                ops.append(Op(s, i, kind, start, finish))
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B orders are deadlock-free
            raise RuntimeError("1F1B simulation deadlocked")
    busy = [sum(o.end - o.start for o in ops if o.stage == s) for s in range(S)]
    return Timeline(S, ops, busy, max(free) if ops else 0.0)


def plan_forward_times(
    plan: Plan, cost_model: CostModel, dp_rank: int = 0, ranks: Mapping[str, int] | None = None
) -> tuple[list[float], list[bool]]:
    """Per-slot forward time and no-op flag of one rank's microbatches (LoRA ranks per job optional)."""
    times, noop = [], []
    for mb in plan.for_rank(dp_rank):
        lens = [e.num_tokens for e in mb.entries]
        rk = [(ranks or {}).get(e.job, 0) for e in mb.entries]
        times.append(cost_model.microbatch_time(lens, rk))
        noop.append(mb.is_noop)
    return times, noop


def simulate_plan(
    plan: Plan,
    cost_model: CostModel | None = None,
    ranks: Mapping[str, int] | None = None,
    backward_ratio: float = 2.0,
    p2p_s: float = 2.0e-4,
) -> list[Timeline]:
    """One timeline per DP rank."""
    cm = cost_model or CostModel()
    out = []
    for r in range(plan.dp_size):
        times, noop = plan_forward_times(plan, cm, r, ranks)
        out.append(simulate_1f1b(times, plan.pipeline_depth, backward_ratio, p2p_s, noop))
    return out


def bubble_ratio(timelines: Sequence[Timeline]) -> float:
    """Bubble over all ranks against the slowest rank's makespan (ranks wait for each other)."""
    span = max((t.makespan for t in timelines), default=0.0)
    if span <= 0:
        return 0.0
    busy = sum(sum(t.busy) for t in timelines)
    return 1.0 - busy / (span * sum(t.num_stages for t in timelines))


def job_spans(plan: Plan, timeline: Timeline, dp_rank: int = 0) -> dict[str, tuple[float, float]]:
    """Per job on one rank: (stage-0 start of its first forward, stage-0 end of its last backward)."""
    spans: dict[str, tuple[float, float]] = {}
    for mb in plan.for_rank(dp_rank):
        for job in mb.jobs:
            f = timeline.op(0, mb.slot, "F").start
            b = timeline.op(0, mb.slot, "B").end
            lo, hi = spans.get(job, (f, b))
            spans[job] = (min(lo, f), max(hi, b))
    return spans

