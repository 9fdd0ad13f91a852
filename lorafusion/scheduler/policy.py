"""Which jobs a planned chunk trains: every active job alike, the shortest first, or the first come
(torch-free).

A chunk is ``rounds`` global batches; :data:`Policy` says whose.

* ``"together"``: ``rounds`` global batches of every active job, packed and pipelined together
  (LoRAFusion's setting: the most throughput when all jobs are known up front).
* ``"shortest_first"``: jobs ordered by priority (higher first), then by remaining work (fewest
  tokens left first: shortest remaining processing time, the order that minimises mean job completion
  time on one machine). The first job gets the chunk's ``rounds`` global batches as its *main* stream;
  the others *fill* the pipeline slots it leaves idle (between two of its global batches 1F1B waits
  ``S - 1`` slots for the optimizer step, see ``verify``), in the same order, whole global batches,
  about as many microbatches as there are idle slots (:func:`idle_slots`). The main job runs as fast
  as alone; the fill is nearly free work for the others. With ``S == 1`` nothing is idle: one job at a
  time, pre-empted at chunk boundaries when a shorter (or higher-priority) one arrives.
* ``"fifo"``: one job at a time, in arrival order (priority first), nothing filled: today's practice of
  running LoRA jobs one after another (each global batch followed by a pipeline flush), inside one run.
  The baseline of the online benchmark; a run that must finish jobs in submission order.

:func:`chunk_jobs` and :func:`take_fill` are shared by the runtime's feed (which draws real batches) and
:class:`~lorafusion.scheduler.online.OnlineScheduler` (which the trace replay drives).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Policy = Literal["together", "shortest_first", "fifo"]
POLICIES: tuple[str, ...] = get_args(Policy)


@dataclass(frozen=True)
class JobWork:
    """What ordering needs to know of an active job."""

    name: str
    priority: int
    remaining_tokens: int  # tokens of the global batches it still has to train (an estimate is fine)


def order(jobs: Sequence[JobWork]) -> list[str]:
    """Higher priority first, then fewer remaining tokens, then the given order."""
    ranked = sorted(range(len(jobs)), key=lambda k: (-jobs[k].priority, jobs[k].remaining_tokens, k))
    return [jobs[k].name for k in ranked]


def chunk_jobs(policy: str, jobs: Sequence[JobWork]) -> tuple[list[str], list[str]]:
    """``(main, fill)`` of the next chunk among the active ``jobs`` (given in arrival order, each with batches
    left): the jobs that get the chunk's ``rounds`` global batches, and the jobs that may fill idle slots, in
    the order they are offered (see :func:`take_fill`)."""
    if not jobs:
        return [], []
    if policy == "together":
        return [j.name for j in jobs], []
    if policy == "fifo":
        first = min(range(len(jobs)), key=lambda k: (-jobs[k].priority, k))
        return [jobs[first].name], []
    if policy == "shortest_first":
        ranked = order(jobs)
        return ranked[:1], ranked[1:]
    raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


def idle_slots(pipeline_depth: int, dp_size: int, rounds: int) -> int:
    """Microbatch positions one job's ``rounds`` global batches leave idle in a chunk: ``S - 1`` slots
    between each two of its batches, on each of the ``dp_size`` ranks."""
    return max(0, rounds - 1) * (pipeline_depth - 1) * dp_size


def microbatches_of(tokens: Sequence[int], capacity: int) -> int:
    """Fewest microbatches of ``capacity`` tokens that can hold a global batch of samples ``tokens``
    long (each cut to the capacity): the packers reach it or come within one."""
    return max(1, math.ceil(sum(min(n, capacity) for n in tokens) / capacity))


def take_fill(order_: Sequence[str], next_batch: Callable[[str], Sequence[int] | None], capacity: int,
              room: int) -> dict[str, int]:
    """Draw fill batches for ``room`` idle microbatch positions: job by job in ``order_``, global batch
    after global batch (``next_batch(job)`` draws one and returns its sample lengths, or None when the
    job has none left), while the microbatches drawn so far are fewer than ``room`` (so the last batch
    may overshoot: it runs after the main stream, which it does not delay). Returns batches per job."""
    taken: dict[str, int] = {}
    used = 0
    for name in order_:
        while used < room:
            tokens = next_batch(name)
            if tokens is None:
                break
            taken[name] = taken.get(name, 0) + 1
            used += microbatches_of(tokens, capacity)
        if used >= room:
            break
    return taken
