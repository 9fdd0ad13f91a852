"""MergePass: fill under-full tail microbatches across neighbouring groups.

Each group-round ("chunk") comes from the DataBatcher fullest-first, its under-full tail last. Chunks
are laid out alternately — even chunks tail last, odd chunks tail first — so the tails of chunks 2p
and 2p+1 are adjacent in the stream. For each such pair the pass merges the two tails into one
microbatch when they fit together, and otherwise moves the largest samples of the emptier tail that
fit into the fuller one. A move is skipped when it would put two global batches of one job into one
microbatch, and a pair's change is undone when it would make the sequencer insert more no-ops — counted on the
stream followed by a repetition of itself, so a merge that only moves a no-op into the next planning
call is refused as well. Positions of everything else are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from .verify import PackedMicrobatch, sequence


def orient(chunks: Sequence[Sequence[PackedMicrobatch]]) -> list[list[PackedMicrobatch]]:
    """Even chunks keep tail-last order, odd chunks are reversed (tail first)."""
    return [list(c) if k % 2 == 0 else list(reversed(c)) for k, c in enumerate(chunks)]


def _conflicts(target: PackedMicrobatch, job: str, batch: int) -> bool:
    return any(e.job == job and e.batch != batch for e in target.entries)


def _ordered(entries, job_rank: Mapping[str, int]):
    return tuple(sorted(entries, key=lambda e: job_rank.get(e.job, len(job_rank))))


def fill_pair(
    a: PackedMicrobatch, b: PackedMicrobatch, capacity: int, job_rank: Mapping[str, int]
) -> tuple[PackedMicrobatch | None, PackedMicrobatch | None]:
    """Move samples from the emptier of adjacent ``a, b`` into the fuller, which keeps its position;
    return the new ``(a, b)``, None where a microbatch was emptied."""
    if a.num_tokens >= b.num_tokens:
        filled, rest = _fill(a, b, capacity, job_rank)
        return filled, rest
    filled, rest = _fill(b, a, capacity, job_rank)
    return rest, filled


def _fill(target: PackedMicrobatch, source: PackedMicrobatch, capacity: int, job_rank: Mapping[str, int]):
    room = capacity - target.num_tokens
    take: set[int] = set()
    for k in sorted(range(len(source.entries)), key=lambda k: -source.entries[k].num_tokens):
        e = source.entries[k]
        if e.num_tokens <= room and not _conflicts(target, e.job, e.batch):
            take.add(k)
            room -= e.num_tokens
    if not take:
        return target, source
    moved = list(target.entries) + [e for k, e in enumerate(source.entries) if k in take]
    kept = [e for k, e in enumerate(source.entries) if k not in take]
    filled = PackedMicrobatch(_ordered(moved, job_rank), -2)
    rest = PackedMicrobatch(tuple(kept), source.group) if kept else None
    return filled, rest


def merge_tails(
    chunks: Sequence[Sequence[PackedMicrobatch]],
    capacity: int,
    noop_count: Callable[[list[PackedMicrobatch]], int],
    job_rank: Mapping[str, int],
    partial: bool = True,
) -> tuple[list[PackedMicrobatch], int]:
    """Return the merged stream (chunks oriented and concatenated) and the number of pairs changed.

    ``partial=False`` (balance "even") only merges two tails that fit together entirely and whose
    sum does not exceed the largest microbatch of the two chunks, so balance is kept."""
    laid = orient(chunks)
    base = noop_count([mb for c in laid for mb in c])
    changed = 0
    for p in range(0, len(laid) - 1, 2):
        left, right = laid[p], laid[p + 1]
        if not left or not right:
            continue
        new_a, new_b = fill_pair(left[-1], right[0], capacity, job_rank)
        if new_a == left[-1] and new_b == right[0]:
            continue
        if not partial:
            biggest = max(mb.num_tokens for mb in left + right)
            merged = [mb for mb in (new_a, new_b) if mb is not None]
            if len(merged) != 1 or merged[0].num_tokens > biggest:
                continue
        trial_left = left[:-1] + ([new_a] if new_a is not None else [])
        trial_right = ([new_b] if new_b is not None else []) + right[1:]
        trial = laid[:p] + [trial_left, trial_right] + laid[p + 2 :]
        count = noop_count([mb for c in trial for mb in c])
        if count <= base:
            laid, base, changed = trial, count, changed + 1
    return [mb for c in laid for mb in c], changed


def _repeat(stream: list[PackedMicrobatch]) -> list[PackedMicrobatch]:
    """The stream followed by a copy of itself with every job's batches shifted past its last one:
    a stand-in for the next planning call, which continues the same pattern."""
    span: dict[str, int] = {}
    lo: dict[str, int] = {}
    for mb in stream:
        for e in mb.entries:
            lo[e.job] = min(lo.get(e.job, e.batch), e.batch)
            span[e.job] = max(span.get(e.job, e.batch), e.batch)
    shift = {j: span[j] - lo[j] + 1 for j in span}
    copy = [
        PackedMicrobatch(tuple(replace(e, batch=e.batch + shift[e.job]) for e in mb.entries), mb.group)
        for mb in stream
    ]
    return stream + copy


def noop_counter(
    pipeline_depth: int, dp_size: int, initial_ready: Mapping[str, int], window: int | None,
    virtual_stages: int = 1,
) -> Callable[[list[PackedMicrobatch]], int]:
    """No-ops the sequencer would insert for a stream followed by its own repetition, so that a merge
    that would only push the cost onto the next planning call is refused too."""

    def count(stream: list[PackedMicrobatch]) -> int:
        mbs, _ = sequence(_repeat(stream), pipeline_depth, dp_size, initial_ready, window,
                          virtual_stages=virtual_stages)
        return sum(mb.is_noop for mb in mbs)

    return count
