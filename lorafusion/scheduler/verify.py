"""The dependency rule, the no-op sequencer that enforces it, and the verifier the runtime calls.

Dependency rule (1F1B on S stages, exact index distance)
-------------------------------------------------------
Each DP rank runs its microbatches in slot order 0, 1, 2, ... through a 1F1B schedule; all ranks run
slot t together. On stage s (0 = first) 1F1B does ``S-1-s`` warm-up forwards, then alternates
``F(t), B(t-(S-1-s))``, then drains the backwards. So on stage s the backward of slot t runs right
after the forward of slot ``t + S-1-s`` and before the forward of slot ``t + S - s``. Stage 0 is the
tightest: B(t) on stage 0 — the last backward of slot t anywhere in the pipeline — comes after F(t+S-1)
and before F(t+S). Job j's gradients for global batch g are complete (and reduced over DP, and its
optimizer can step) once the backward of L = the last slot holding (j, g) has finished on stage 0;
the forward of a slot holding (j, g+1) on stage 0 reads the updated adapter. Hence:

    first_slot(j, g+1)  >=  last_slot(j, g) + S

i.e. at least S-1 slots of other work (or no-ops) between two global batches of one adapter; the
order of ops on every stage is fixed by 1F1B, so the rule is independent of microbatch durations. On
a later stage s the step needs only ``first_slot >= last_slot + S - s``, implied by the stage-0 rule.
With S == 1 consecutive slots are fine. With DP > 1 the rule holds on slots (the DP gradient
reduction of (j, g) waits for slot L on every rank). A plan that continues an earlier one carries
``Plan.initial_ready[j]``: the first slot where j's first batch in this plan may start.

Interleaved 1F1B (V model chunks per rank) orders the ops differently; :mod:`.pipeorder` derives the rule
from Megatron's order (``first_slot(j, g+1) >= start_slot(last_slot(j, g))``, about 2S slots apart with V=2)
and the sequencer keeps the largest such distance, :func:`dependency_distance`.

:func:`sequence` places packed microbatches into slots in stream order, looking ahead a bounded window
for a microbatch that is ready, and inserts a no-op only when nothing in the window may run;
:func:`verify_plan` proves a plan obeys the rule, the capacity, per-job contiguity, and that every
sample of the given jobs appears exactly once; it raises :class:`PlanError` naming job, batch and
microbatch, and returns a :class:`VerifyReport`.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .pipeorder import check_slot_count, dependency_distance, start_slot
from .spec import Entry, JobSpec, Microbatch, Plan, PlanError


@dataclass(frozen=True)
class PackedMicrobatch:
    """A packed microbatch not yet placed into a slot (entries of one job contiguous)."""

    entries: tuple[Entry, ...]
    group: int = 0

    @property
    def keys(self) -> tuple[tuple[str, int], ...]:
        return tuple(dict.fromkeys((e.job, e.batch) for e in self.entries))

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass
class _State:
    remaining: Counter
    last_slot: dict[tuple[str, int], int]
    prev: dict[tuple[str, int], tuple[str, int] | None]
    initial_ready: Mapping[str, int]
    gap: int

    def ready(self, mb: PackedMicrobatch, slot: int) -> bool:
        for key in mb.keys:
            prev = self.prev[key]
            if prev is None:
                if slot < self.initial_ready.get(key[0], 0):
                    return False
            elif self.remaining[prev] > 0 or slot < self.last_slot[prev] + self.gap:
                return False
        return True


def _predecessors(stream: Sequence[PackedMicrobatch]) -> dict[tuple[str, int], tuple[str, int] | None]:
    batches: dict[str, set[int]] = defaultdict(set)
    for mb in stream:
        for job, batch in mb.keys:
            batches[job].add(batch)
    prev: dict[tuple[str, int], tuple[str, int] | None] = {}
    for job, bs in batches.items():
        ordered = sorted(bs)
        for k, b in enumerate(ordered):
            prev[job, b] = (job, ordered[k - 1]) if k else None
    return prev


def sequence(
    stream: Sequence[PackedMicrobatch],
    pipeline_depth: int,
    dp_size: int = 1,
    initial_ready: Mapping[str, int] | None = None,
    window: int | None = None,
    fill: Sequence[PackedMicrobatch] = (),
    virtual_stages: int = 1,
) -> tuple[list[Microbatch], dict[tuple[str, int], int]]:
    """Place ``stream`` into slots of ``dp_size`` microbatches, obeying the dependency rule.

    Each slot's ranks take, in stream order, the first microbatch within ``window`` pending ones
    that is ready; a rank with none takes the first ready one of the ``fill`` stream (same window), and
    gets a no-op when neither has one. So ``fill`` only runs where ``stream`` would leave the pipeline
    idle (and after ``stream`` ends): ``stream`` is placed exactly as without it. Returns the
    microbatches (sorted by slot, rank) and ``last_microbatch[(job, batch)]``. Raises PlanError when
    the streams can never become ready (one microbatch holding two batches of a job, or batch g+1 before
    batch g) or share a global batch. ``virtual_stages`` > 1: the distance of interleaved 1F1B.
    """
    initial_ready = dict(initial_ready or {})
    window = window or 2 * pipeline_depth * dp_size + 4
    main_keys = {k for mb in stream for k in mb.keys}
    if shared := main_keys & {k for mb in fill for k in mb.keys}:
        raise PlanError(f"the fill stream holds global batches of the main stream: {sorted(shared)[:3]}")
    state = _State(
        remaining=Counter(k for mb in (*stream, *fill) for k in mb.keys),
        last_slot={},
        prev=_predecessors([*stream, *fill]),
        initial_ready=initial_ready,
        gap=dependency_distance(pipeline_depth, virtual_stages),
    )
    queues = (list(stream), list(fill))
    out: list[Microbatch] = []
    last_mb: dict[tuple[str, int], int] = {}
    slot, idle = 0, 0
    max_idle = state.gap + max([0, *initial_ready.values()]) + 1
    while any(queues):
        placed = 0
        for rank in range(dp_size):
            mb = _take_ready(queues, state, slot, window)
            if mb is None:
                out.append(Microbatch(len(out), slot, rank, (), is_noop=True, group=-1))
                continue
            for key in mb.keys:
                state.remaining[key] -= 1
                state.last_slot[key] = slot
                last_mb[key] = len(out)
            out.append(Microbatch(len(out), slot, rank, mb.entries, is_noop=False, group=mb.group))
            placed += 1
        idle = 0 if placed else idle + 1
        if idle > max_idle:
            stuck = next(q for q in queues if q)[0]
            raise PlanError(
                f"stream cannot be sequenced: microbatch with {stuck.keys} can never become ready "
                "(a microbatch mixes two global batches of one job, or batch g+1 precedes batch g)"
            )
        slot += 1
    return out, last_mb


def _take_ready(queues, state: _State, slot: int, window: int) -> PackedMicrobatch | None:
    """Pop the first microbatch within ``window`` pending ones of the first queue that has a ready one."""
    for pending in queues:
        pick = next((k for k, mb in enumerate(pending[:window]) if state.ready(mb, slot)), None)
        if pick is not None:
            return pending.pop(pick)
    return None


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_plan` checked and counted."""

    num_microbatches: int
    num_slots: int
    num_noops: int
    num_samples: int
    num_tokens: int
    min_gap: dict[str, int]  # per job: smallest first_slot(g+1) - last_slot(g) seen (absent: 1 batch)


def _fail(msg: str) -> None:
    raise PlanError(msg)


def _check_layout(plan: Plan, dp_size: int) -> None:
    for k, mb in enumerate(plan.microbatches):
        if mb.index != k or mb.slot != k // dp_size or mb.dp_rank != k % dp_size:
            _fail(
                f"microbatch {k}: index/slot/dp_rank ({mb.index}, {mb.slot}, {mb.dp_rank}) break the "
                f"layout (every slot holds dp_size={dp_size} microbatches, ranks 0..{dp_size - 1})"
            )
        if mb.is_noop != (len(mb.entries) == 0):
            _fail(f"microbatch {k}: is_noop={mb.is_noop} but it has {len(mb.entries)} entries")
    if len(plan.microbatches) % dp_size:
        _fail(f"plan has {len(plan.microbatches)} microbatches, not a multiple of dp_size={dp_size}")


def _check_microbatch(mb: Microbatch, capacity: int) -> None:
    if mb.num_tokens > capacity:
        _fail(f"microbatch {mb.index} has {mb.num_tokens} tokens, capacity is {capacity}")
    seen: set[str] = set()
    for k, e in enumerate(mb.entries):
        if k and e.job != mb.entries[k - 1].job and e.job in seen:
            _fail(f"microbatch {mb.index}: entries of job {e.job!r} are not contiguous")
        seen.add(e.job)
        if e.num_tokens <= 0:
            _fail(f"microbatch {mb.index}: job {e.job!r} sample {e.sample_id!r} has {e.num_tokens} tokens")


def _expected(jobs: Sequence[JobSpec], capacity: int) -> dict[tuple[str, int, object], int]:
    want: dict[tuple[str, int, object], int] = {}
    for job in jobs:
        for k, batch in enumerate(job.global_batches):
            g = job.first_batch_index + k
            for sid, n in batch:
                key = (job.name, g, sid)
                if key in want:
                    _fail(f"job {job.name!r} batch {g}: sample id {sid!r} appears twice in the input")
                want[key] = min(n, capacity) if job.truncate else n
    return want


def _check_samples(plan: Plan, jobs: Sequence[JobSpec]) -> int:
    want = _expected(jobs, plan.token_capacity)
    seen: dict[tuple[str, int, object], int] = {}
    for mb in plan.microbatches:
        for e in mb.entries:
            key = (e.job, e.batch, e.sample_id)
            if key not in want:
                _fail(f"microbatch {mb.index}: job {e.job!r} batch {e.batch} sample {e.sample_id!r} "
                      "is not in the jobs' input")
            if key in seen:
                _fail(f"job {e.job!r} batch {e.batch} sample {e.sample_id!r} appears twice "
                      f"(microbatches {seen[key]} and {mb.index})")
            if e.num_tokens != want[key]:
                _fail(f"microbatch {mb.index}: job {e.job!r} batch {e.batch} sample {e.sample_id!r} has "
                      f"{e.num_tokens} tokens, expected {want[key]}")
            seen[key] = mb.index
    missing = [k for k in want if k not in seen]
    if missing:
        job, g, sid = missing[0]
        _fail(f"job {job!r} batch {g} sample {sid!r} is missing from the plan ({len(missing)} missing)")
    return len(seen)


def _check_dependencies(plan: Plan, pipeline_depth: int, virtual_stages: int = 1) -> dict[str, int]:
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for mb in plan.microbatches:
        for e in mb.entries:
            key = (e.job, e.batch)
            first.setdefault(key, mb.index)
            last[key] = mb.index
    for key, idx in last.items():
        if plan.last_microbatch.get(key) != idx:
            _fail(f"job {key[0]!r} batch {key[1]}: last_microbatch says "
                  f"{plan.last_microbatch.get(key)}, but its last microbatch is {idx}")
    extra = set(plan.last_microbatch) - set(last)
    if extra:
        job, g = min(extra)
        _fail(f"job {job!r} batch {g}: in last_microbatch but has no samples in the plan")
    by_job: dict[str, list[int]] = defaultdict(list)
    for job, g in first:
        by_job[job].append(g)
    slot = [mb.slot for mb in plan.microbatches]
    how = f"1F1B with S={pipeline_depth}" if virtual_stages == 1 else \
        f"interleaved 1F1B with S={pipeline_depth}, V={virtual_stages}"
    min_gap: dict[str, int] = {}
    for job, gs in by_job.items():
        gs.sort()
        start = slot[first[job, gs[0]]]
        if start < plan.initial_ready.get(job, 0):
            _fail(f"job {job!r} batch {gs[0]} starts at microbatch {first[job, gs[0]]} (slot {start}) "
                  f"before its carried ready slot {plan.initial_ready[job]}")
        for a, b in itertools.pairwise(gs):
            d = slot[first[job, b]] - slot[last[job, a]]
            min_gap[job] = min(min_gap.get(job, d), d)
            need = start_slot(slot[last[job, a]], pipeline_depth, virtual_stages) - slot[last[job, a]]
            if d < need:
                _fail(
                    f"dependency violated: job {job!r} batch {b} enters stage 0 at microbatch "
                    f"{first[job, b]} (slot {slot[first[job, b]]}) but batch {a} ends at microbatch "
                    f"{last[job, a]} (slot {slot[last[job, a]]}); {how} needs a "
                    f"slot distance >= {need}, got {d}"
                )
    return min_gap


def verify_plan(plan: Plan, jobs: Sequence[JobSpec], pipeline_depth: int, dp_size: int = 1,
                virtual_stages: int = 1) -> VerifyReport:
    """Prove ``plan`` is executable for ``jobs`` on S = ``pipeline_depth`` stages and ``dp_size`` ranks.

    Checks: layout (slot = index // dp, rank = index % dp), no-op flags, capacity, per-job
    contiguity inside each microbatch, every input sample exactly once with its token count (capped
    at the capacity for truncating jobs), ``last_microbatch``, and the dependency rule of the module
    docstring (``virtual_stages`` > 1: interleaved 1F1B's, and a slot count Megatron's interleaved schedule
    takes). Raises PlanError on the first violation; returns counts otherwise.
    """
    if (plan.pipeline_depth, plan.dp_size, plan.virtual_stages) != (pipeline_depth, dp_size, virtual_stages):
        _fail(f"plan was made for S={plan.pipeline_depth}, dp={plan.dp_size}, V={plan.virtual_stages}; "
              f"verifying for S={pipeline_depth}, dp={dp_size}, V={virtual_stages}")
    _check_layout(plan, dp_size)
    check_slot_count(plan.num_slots, pipeline_depth, virtual_stages)
    for mb in plan.microbatches:
        _check_microbatch(mb, plan.token_capacity)
    num_samples = _check_samples(plan, jobs)
    min_gap = _check_dependencies(plan, pipeline_depth, virtual_stages)
    return VerifyReport(
        num_microbatches=len(plan.microbatches),
        num_slots=plan.num_slots,
        num_noops=plan.num_noops,
        num_samples=num_samples,
        num_tokens=sum(mb.num_tokens for mb in plan.microbatches),
        min_gap=min_gap,
    )
