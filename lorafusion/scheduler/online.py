"""Online multi-job scheduling (tLoRA-style): jobs join and leave between global batches.

:class:`OnlineScheduler` plans the next ``rounds`` global batches of every active job per call. Plans
already returned are never changed (finished and in-flight work is not disturbed); the next plan
continues the slot stream, carrying each job's dependency constraint as ``Plan.initial_ready``. A job
that joins starts with its next call; a job that leaves gets no further batches (what was planned
stays). Jobs may differ in global batch size, LoRA rank (cost per token grows with rank in the
simulated cost) and priority (higher priority first inside groups and microbatches). :meth:`report`
simulates the whole stream and each job alone and reports the job's slowdown against running alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import policy
from .costmodel import CostModel
from .pipeorder import dependency_distance, start_slot
from .planner import plan as make_plan
from .simulate import job_spans, simulate_plan
from .spec import JobSpec, Microbatch, Plan, PlanError, PlanStats, SchedulerConfig


def concat_plans(plans: list[Plan]) -> Plan:
    """One plan equal to running ``plans`` back to back (slots and indices shifted)."""
    if not plans:
        raise PlanError("concat_plans needs at least one plan")
    first = plans[0]
    mbs: list[Microbatch] = []
    last: dict[tuple[str, int], int] = {}
    slot0 = 0
    for p in plans:
        if (p.pipeline_depth, p.dp_size, p.token_capacity, p.virtual_stages) != (
            first.pipeline_depth, first.dp_size, first.token_capacity, first.virtual_stages
        ):
            raise PlanError(
                "concat_plans: plans differ in pipeline depth, dp size, capacity or virtual stages")
        base = len(mbs)
        for mb in p.microbatches:
            mbs.append(replace(mb, index=base + mb.index, slot=slot0 + mb.slot))
        for key, idx in p.last_microbatch.items():
            last[key] = base + idx
        slot0 += p.num_slots
    return Plan(mbs, first.pipeline_depth, first.dp_size, first.token_capacity, last,
                dict(first.initial_ready), PlanStats(num_noops=sum(m.is_noop for m in mbs)),
                first.virtual_stages)


@dataclass(frozen=True)
class JobReport:
    name: str
    batches_planned: int
    step_slots: tuple[int, ...]  # global slot after which each planned batch's optimizer steps
    shared_s: float  # simulated time from its first forward to its last backward, sharing the GPUs
    alone_s: float  # simulated time of its planned batches alone (one job, no grouping)
    slowdown: float  # shared_s / alone_s


class OnlineScheduler:
    """Stateful planner over a growing stream of plans; see the module docstring."""

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        self.cost_model = cost_model or CostModel()
        self.specs: dict[str, JobSpec] = {}
        self.active: list[str] = []
        self.cursor: dict[str, int] = {}
        self.ready: dict[str, int] = {}  # absolute slot where the job's next batch may start
        self.plans: list[Plan] = []
        self.slots = 0
        self.groups: list[list[str]] | None = None  # kept while the set of planned jobs is unchanged

    def add_job(self, job: JobSpec) -> None:
        """Join: the job's batches are planned from the next call on."""
        if job.name in self.active:
            raise PlanError(f"job {job.name!r} is already running")
        if job.name in self.specs:
            raise PlanError(f"job {job.name!r} already ran; rejoin under a new name")
        self.specs[job.name] = job
        self.active.append(job.name)
        self.cursor[job.name] = 0

    def remove_job(self, name: str) -> None:
        """Leave: no further batches of the job are planned; planned ones stay."""
        if name not in self.active:
            raise PlanError(f"job {name!r} is not running")
        self.active.remove(name)

    def _chunk_part(self, name: str, rounds: int) -> JobSpec | None:
        """Job ``name`` restricted to its next ``rounds`` unplanned global batches (its part of the chunk)."""
        job, k = self.specs[name], self.cursor[name]
        batches = list(job.global_batches[k : k + rounds])
        if not batches:
            return None
        return replace(job, global_batches=batches, first_batch_index=job.first_batch_index + k)

    def remaining_tokens(self, name: str) -> int:
        """Tokens of the job's global batches not planned yet."""
        job = self.specs[name]
        return sum(n for b in job.global_batches[self.cursor[name]:] for _, n in b)

    def plan_next(self, rounds: int = 1) -> Plan | None:
        """Plan the next chunk (None when nothing is left): the jobs :func:`policy.chunk_jobs` names under
        ``config.policy`` get ``rounds`` global batches each, its fill jobs the idle slots."""
        works = [policy.JobWork(n, self.specs[n].priority, self.remaining_tokens(n)) for n in self.active]
        names, fill_order = policy.chunk_jobs(self.config.policy,
                                              [w for w in works if w.remaining_tokens > 0])
        main = [j for n in names if (j := self._chunk_part(n, rounds)) is not None]
        seen = dict.fromkeys(fill_order, 0)

        def next_batch(name: str):  # looks at the job's next unplanned batch
            k = self.cursor[name] + seen[name]
            if k >= len(self.specs[name].global_batches):
                return None
            seen[name] += 1
            return [n for _, n in self.specs[name].global_batches[k]]

        room = policy.idle_slots(dependency_distance(self.config.pipeline_depth, self.config.virtual_stages),
                                 self.config.dp_size, rounds)
        taken = (policy.take_fill(fill_order, next_batch, self.config.token_capacity, room)
                 if fill_order else {})
        fill = [j for n, k in taken.items() if (j := self._chunk_part(n, k)) is not None]
        if not main:
            return None
        parts = main + fill
        ready = {j.name: max(0, self.ready.get(j.name, 0) - self.slots) for j in parts}
        if fill or self.groups is None or {n for g in self.groups for n in g} != {j.name for j in main}:
            self.groups = None
        p = make_plan(main, self.config, ready, self.groups, fill)
        self.groups = None if fill else (self.groups or p.stats.groups)
        for (job, _), idx in sorted(p.last_microbatch.items(), key=lambda kv: kv[1]):
            self.ready[job] = self.slots + start_slot(p.microbatches[idx].slot, self.config.pipeline_depth,
                                                      self.config.virtual_stages)
        for j in parts:
            self.cursor[j.name] += len(j.global_batches)
            if self.cursor[j.name] >= len(self.specs[j.name].global_batches):
                self.active.remove(j.name)
        self.plans.append(p)
        self.slots += p.num_slots
        return p

    def combined(self) -> Plan:
        """All plans so far as one plan (what the runtime has been given, in order)."""
        return concat_plans(self.plans)

    def planned_jobs(self) -> list[JobSpec]:
        """Each job restricted to the global batches planned so far (input for ``verify_plan``)."""
        out = []
        for name, job in self.specs.items():
            k = self.cursor[name]
            if k:
                out.append(replace(job, global_batches=list(job.global_batches[:k])))
        return out

    def report(self) -> dict[str, JobReport]:
        """Simulated shared vs alone time per job (DP rank 0), and optimizer-step slots."""
        combined = self.combined()
        ranks = {n: j.rank for n, j in self.specs.items()}
        spans = job_spans(combined, simulate_plan(combined, self.cost_model, ranks)[0])
        steps: dict[str, list[int]] = {}
        for (job, _), idx in sorted(combined.last_microbatch.items(), key=lambda kv: kv[0]):
            steps.setdefault(job, []).append(combined.microbatches[idx].slot)
        out = {}
        for job in self.planned_jobs():
            alone_cfg = replace(self.config, grouping=False)
            alone = make_plan([job], alone_cfg)
            alone_s = simulate_plan(alone, self.cost_model, ranks)[0].makespan
            lo, hi = spans.get(job.name, (0.0, 0.0))
            out[job.name] = JobReport(
                job.name, len(job.global_batches), tuple(steps.get(job.name, ())), hi - lo, alone_s,
                (hi - lo) / alone_s if alone_s > 0 else float("nan"),
            )
        return out
