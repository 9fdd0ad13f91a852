"""MergePass: fill under-full tail microbatches across neighbouring groups.

Each group-round ("chunk") comes from the DataBatcher fullest-first, its under-full tail last. Chunks
are laid out alternately — even chunks tail last, odd chunks tail first — so the tails of chunks 2p
and 2p+1 are adjacent in the stream. For each such pair the pass merges the two tails into one
microbatch when they fit together, and otherwise moves the largest samples of the emptier tail that
fit into the fuller one. A move is skipped when it would put two global batches of one job into one
microbatch, and a pair's change is undone when it would make the sequencer insert more no-ops (the
dependency rule allows it only then); positions of everything else are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
) -> tuple[list[PackedMicrobatch], int]:
    """Return the merged stream (chunks oriented and concatenated) and the number of pairs changed."""
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
        trial_left = left[:-1] + ([new_a] if new_a is not None else [])
        trial_right = ([new_b] if new_b is not None else []) + right[1:]
        trial = laid[:p] + [trial_left, trial_right] + laid[p + 2 :]
        count = noop_count([mb for c in trial for mb in c])
        if count <= base:
            laid, base, changed = trial, count, changed + 1
    return [mb for c in laid for mb in c], changed


def noop_counter(
    pipeline_depth: int, dp_size: int, initial_ready: Mapping[str, int], lookahead: int | None
) -> Callable[[list[PackedMicrobatch]], int]:
    """The no-op count the sequencer would produce for a stream (used to accept or undo merges)."""

    def count(stream: list[PackedMicrobatch]) -> int:
        mbs, _ = sequence(stream, pipeline_depth, dp_size, initial_ready, lookahead)
        return sum(mb.is_noop for mb in mbs)

    return count
