"""Pipeline simulator (1F1B and interleaved 1F1B): per-stage timeline, bubble ratio (charts of a plan:
:mod:`.charts`).

Model: S pipeline ranks, each holding V model chunks (V = 1: plain 1F1B); virtual stage ``k = c·S + r`` is
chunk c of rank r. A microbatch whose whole-model forward takes f seconds (from a
:class:`~.costmodel.CostModel`) takes ``f·fwd[k]`` forward and ``f·bwd[k]`` backward on virtual stage k
(``stage_costs``: equal shares ``1/(S·V)`` and ``backward_ratio/(S·V)`` unless given, e.g. by
:mod:`.stages` with the output layer and loss on the last one); each activation/gradient hand-over between
ranks adds ``p2p_s``; each op of a microbatch on a model chunk also takes ``op_s`` of fixed work on its rank
(the host's per-op cost: a schedule step, its p2p calls, the launches of a chunk's first kernels; 0 unless
given).
Every rank runs its ops in Megatron's order (:func:`.pipeorder.stage_order`); an op
starts when its rank is free and its input has arrived. No-op microbatches take no time and send nothing,
so they only delay through the op order — which is exactly how they realise the dependency rule. Bubble
ratio = 1 − Σ busy / (S · makespan); per rank ``1 − busy[r] / makespan``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .costmodel import CostModel
from .pipeorder import stage_order
from .spec import Plan

StageCosts = Sequence[tuple[float, float]]  # per virtual stage: (forward, backward) as a fraction of f


@dataclass(frozen=True)
class Op:
    stage: int
    slot: int
    kind: str  # "F" or "B"
    start: float
    end: float
    chunk: int = 0  # model chunk of the rank (interleaved 1F1B)


@dataclass
class Timeline:
    """Scheduled ops of one DP rank; ``busy[s]`` is pipeline rank s's compute time."""

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

    @property
    def stage_bubbles(self) -> list[float]:
        """Per pipeline rank: the share of the makespan it is idle (what the runtime's stage timers
        measure)."""
        return [0.0 if self.makespan <= 0 else 1.0 - b / self.makespan for b in self.busy]

    def op(self, stage: int, slot: int, kind: str, chunk: int = 0) -> Op:
        return self._index[stage, slot, kind, chunk]

    def __post_init__(self) -> None:
        self._index = {(o.stage, o.slot, o.kind, o.chunk): o for o in self.ops}


def one_f_one_b_order(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The op order of ``stage`` in 1F1B: warm-up forwards, steady F/B pairs, drain backwards."""
    return [(kind, i) for kind, i, _ in stage_order(num_stages, stage, num_microbatches)]


def equal_stage_costs(num_stages: int, virtual_stages: int = 1,
                      backward_ratio: float = 2.0) -> list[tuple[float, float]]:
    n = num_stages * virtual_stages
    return [(1.0 / n, backward_ratio / n)] * n


def simulate_1f1b(
    forward_s: Sequence[float],
    num_stages: int,
    backward_ratio: float = 2.0,
    p2p_s: float = 0.0,
    noop: Sequence[bool] | None = None,
    virtual_stages: int = 1,
    stage_costs: StageCosts | None = None,
    op_s: float = 0.0,
) -> Timeline:
    """Simulate one rank; ``forward_s[t]`` is slot t's whole-model forward time (interleaved when V > 1)."""
    m, S, V = len(forward_s), num_stages, virtual_stages
    costs = list(stage_costs) if stage_costs is not None else equal_stage_costs(S, V, backward_ratio)
    if len(costs) != S * V:
        raise ValueError(f"stage_costs: expected {S * V} (forward, backward) pairs, got {len(costs)}")
    noop = list(noop) if noop is not None else [False] * m
    orders = [stage_order(S, s, m, V) for s in range(S)]
    pos, free = [0] * S, [0.0] * S
    end: dict[tuple[int, int, str], float] = {}  # (virtual stage, microbatch, kind) -> end time
    ops: list[Op] = []
    last = S * V - 1
    while any(pos[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, i, c = orders[s][pos[s]]
                k = c * S + s
                if kind == "F":
                    dep = (k - 1, i, "F") if k > 0 else None
                else:
                    dep = (k + 1, i, "B") if k < last else (k, i, "F")
                if dep is not None and dep not in end:
                    break
                hop = 0.0 if dep is None or dep[0] == k or noop[i] else p2p_s
                ready = 0.0 if dep is None else end[dep] + hop
                start = max(free[s], ready)
                share = costs[k][0 if kind == "F" else 1]
                finish = start + (0.0 if noop[i] else share * forward_s[i] + op_s)
                end[k, i, kind] = free[s] = finish
                ops.append(Op(s, i, kind, start, finish, c))
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - Megatron's orders are deadlock-free
            raise RuntimeError("pipeline simulation deadlocked")
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
    stage_costs: StageCosts | None = None,
    op_s: float = 0.0,
) -> list[Timeline]:
    """One timeline per DP rank, on the plan's pipeline depth and virtual stages."""
    cm = cost_model or CostModel()
    out = []
    for r in range(plan.dp_size):
        times, noop = plan_forward_times(plan, cm, r, ranks)
        out.append(simulate_1f1b(times, plan.pipeline_depth, backward_ratio, p2p_s, noop,
                                 plan.virtual_stages, stage_costs, op_s))
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

