"""The planning pipeline: AdapterGrouper → DataBatcher (per group and round) → MergePass → sequencer.

Stream layout: for round r = 0, 1, ... and each group in grouper order, the group's jobs' r-th global
batch in this call (jobs in priority order) are packed together into one chunk of microbatches.
Chunks are merged at their tails and sequenced into slots with no-ops where the dependency rule
demands them (see :mod:`.verify`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from .batcher import DataBatcher
from .grouper import AdapterGrouper, JobLoad
from .merge import merge_tails, noop_counter, orient
from .pipeorder import dependency_distance, interleave_padding
from .spec import Entry, JobSpec, Microbatch, Plan, PlanError, PlanStats, SampleTooLongError, SchedulerConfig
from .verify import PackedMicrobatch, sequence


def job_entries(job: JobSpec, capacity: int) -> list[list[Entry]]:
    """Entries per global batch; raises SampleTooLongError unless the job truncates."""
    out = []
    for k, batch in enumerate(job.global_batches):
        g = job.first_batch_index + k
        entries = []
        for sid, n in batch:
            if n <= 0:
                raise PlanError(f"job {job.name!r} batch {g}: sample {sid!r} has {n} tokens")
            if n > capacity and not job.truncate:
                raise SampleTooLongError(
                    f"job {job.name!r} batch {g}: sample {sid!r} has {n} tokens, more than the "
                    f"token capacity {capacity} (set truncate on the job to cut it)"
                )
            entries.append(Entry(job.name, g, sid, min(n, capacity)))
        out.append(entries)
    return out


def _job_rank(jobs: Sequence[JobSpec]) -> dict[str, int]:
    order = sorted(range(len(jobs)), key=lambda k: (-jobs[k].priority, k))
    return {jobs[k].name: r for r, k in enumerate(order)}


def _loads(jobs: Sequence[JobSpec], capacity: int) -> list[JobLoad]:
    out = []
    for j in jobs:
        tokens = sum(min(n, capacity) for b in j.global_batches for _, n in b)
        out.append(JobLoad(j.name, tokens / capacity / max(1, len(j.global_batches)), j.priority))
    return out


def _pack_chunk(entries: list[Entry], batcher: DataBatcher, group: int, budget: float, stats: PlanStats):
    res = batcher.pack([e.num_tokens for e in entries], budget)
    stats.pack_sources[res.source] = stats.pack_sources.get(res.source, 0) + 1
    return [PackedMicrobatch(tuple(entries[i] for i in b), group) for b in res.bins]


def spread_over_ranks(chunk: list[PackedMicrobatch], dp_size: int) -> list[PackedMicrobatch]:
    """Split microbatches of a chunk until it has at least ``dp_size`` of them (while any holds more than
    one sample), so that every data-parallel rank gets work in a slot rather than a no-op: the largest
    microbatch is cut into a prefix and a suffix of about equal tokens (each job's entries stay
    contiguous). Splitting never breaks the dependency rule (the pieces hold the same global batches)."""
    out = list(chunk)
    while len(out) < dp_size:
        cand = [k for k, mb in enumerate(out) if len(mb.entries) > 1]
        if not cand:
            break
        k = max(cand, key=lambda i: (out[i].num_tokens, -i))
        mb = out[k]
        half, acc, cut = mb.num_tokens / 2, 0, 1
        for i, e in enumerate(mb.entries[:-1], start=1):
            acc += e.num_tokens
            cut = i
            if acc >= half:
                break
        out[k:k + 1] = [PackedMicrobatch(mb.entries[:cut], mb.group),
                        PackedMicrobatch(mb.entries[cut:], mb.group)]
    return out


def _choose_groups(jobs, config: SchedulerConfig, capacity: int, groups) -> list[list[str]]:
    if groups is None:
        # the grouper staggers groups by the dependency distance (S for 1F1B, about 2S interleaved)
        depth = dependency_distance(config.pipeline_depth, config.virtual_stages)
        grouper = AdapterGrouper(depth, config.dp_size, config.grouping)
        return grouper.group(_loads(jobs, capacity))
    names = [j.name for j in jobs]
    out = [[n for n in g if n in names] for g in groups]
    placed = {n for g in out for n in g}
    out += [[n] for n in names if n not in placed]
    return [g for g in out if g]


def _order_groups(groups: list[list[str]], ready: Mapping[str, int]) -> list[list[str]]:
    return sorted(groups, key=lambda g: max(ready.get(n, 0) for n in g))


def plan(
    jobs: Sequence[JobSpec],
    config: SchedulerConfig,
    initial_ready: Mapping[str, int] | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    fill: Sequence[JobSpec] = (),
) -> Plan:
    """Plan all global batches of ``jobs``; ``initial_ready`` carries constraints from an earlier plan.

    ``groups`` fixes the grouping (jobs absent from ``jobs`` are ignored; jobs missing from it form
    their own groups), else the AdapterGrouper chooses. Groups whose jobs become ready earliest go
    first. ``config.milp_time_limit_s`` is the MILP budget of the whole call, shared by its packings.

    ``fill`` jobs are planned the same way into a second stream that only takes the slots the first
    would leave idle (and follows it): ``jobs`` run as fast as without them (see :func:`sequence`).
    """
    t0 = time.perf_counter()
    names = [j.name for j in (*jobs, *fill)]
    if len(set(names)) != len(names):
        raise PlanError(f"job names must be unique, got {names}")
    capacity = config.token_capacity
    stats = PlanStats()
    ready = dict(initial_ready or {})
    deadline = t0 + config.milp_time_limit_s
    # with fill jobs, the main stream's packings get the first half of the MILP budget
    main_deadline = t0 + config.milp_time_limit_s / 2 if fill else deadline
    stream = _stream(jobs, config, capacity, ready, groups, stats, main_deadline)
    fill_stream = _stream(fill, config, capacity, ready, None, stats, deadline) if fill else []
    mbs, last = sequence(stream, config.pipeline_depth, config.dp_size, ready, config.sequencer_window,
                         fill_stream, config.virtual_stages)
    mbs += _padding(mbs, config)
    stats.num_noops = sum(mb.is_noop for mb in mbs)
    stats.plan_s = time.perf_counter() - t0
    return Plan(mbs, config.pipeline_depth, config.dp_size, capacity, last, ready, stats,
                config.virtual_stages)


def _padding(mbs: list[Microbatch], config: SchedulerConfig) -> list[Microbatch]:
    """No-op slots at the end so interleaved 1F1B takes the plan (a multiple of S microbatches per rank)."""
    slots = 0 if not mbs else mbs[-1].slot + 1
    extra = interleave_padding(slots, config.pipeline_depth, config.virtual_stages)
    return [Microbatch(len(mbs) + k, slots + k // config.dp_size, k % config.dp_size, (), is_noop=True,
                       group=-1)
            for k in range(extra * config.dp_size)]


def _stream(jobs: Sequence[JobSpec], config: SchedulerConfig, capacity: int, ready: Mapping[str, int],
            groups, stats: PlanStats, deadline: float) -> list[PackedMicrobatch]:
    """The packed, merged microbatch stream of ``jobs`` (groups → rounds → packings → MergePass)."""
    if not jobs:
        return []
    entries = {j.name: job_entries(j, capacity) for j in jobs}
    rank = _job_rank(jobs)
    chosen = _order_groups(_choose_groups(jobs, config, capacity, groups), ready)
    base = len(stats.groups)  # group numbers run on over the main and the fill stream
    stats.groups += chosen
    batcher = DataBatcher(
        capacity, config.milp_time_limit_s, config.solver, config.max_milp_vars, config.balance,
        config.milp_gap,
    )
    rounds = max((len(b) for b in entries.values()), default=0)
    todo = [
        (r, base + gi, [e for name in sorted(g, key=rank.__getitem__) if r < len(entries[name])
                 for e in entries[name][r]])
        for r in range(rounds) for gi, g in enumerate(chosen)
    ]
    todo = [t for t in todo if t[2]]
    chunks = []
    for k, (_, gi, ents) in enumerate(todo):
        budget = max(0.0, deadline - time.perf_counter()) / (len(todo) - k)
        chunks.append(spread_over_ranks(_pack_chunk(ents, batcher, gi, budget, stats), config.dp_size))
    if config.merge:
        count = noop_counter(config.pipeline_depth, config.dp_size, ready, config.sequencer_window,
                             config.virtual_stages)
        stream, merges = merge_tails(chunks, capacity, count, rank, config.balance == "fill")
        stats.merges += merges
        return stream
    return [mb for c in orient(chunks) for mb in c]
