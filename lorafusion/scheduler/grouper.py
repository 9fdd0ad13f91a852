"""AdapterGrouper: split jobs into groups whose global batches are staggered in the stream.

The planner emits, for every round r, group 0's batch r of each of its jobs, then group 1's, and so
on. Between two consecutive batches of a job in group k lie the microbatches of all other groups, so
the dependency rule (see :mod:`.verify`) needs, per group k:

    Σ_{other groups} microbatches per round  >=  (S - 1) · dp_size

(the paper's rule "the other jobs supply at least S−1 microbatches", in DP slots). Loads are
estimated as tokens / capacity per job and ceil(Σ) per group. We take the fewest groups (>= 2, so jobs in one
group share packing) for which a longest-processing-time (LPT) balanced partition meets the rule for every
group; if no partition does, every job gets its own group (the largest stagger possible) and the sequencer
inserts the no-ops that remain unavoidable. With S == 1, or grouping off, all jobs form one group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class JobLoad:
    """A job's estimated microbatches per global batch (tokens / capacity) and its priority."""

    name: str
    microbatches: float
    priority: int = 0


def lpt_partition(loads: list[JobLoad], k: int) -> list[list[JobLoad]]:
    """Longest-processing-time partition into ``k`` groups (heaviest job to the lightest group)."""
    groups: list[list[JobLoad]] = [[] for _ in range(k)]
    totals = [0.0] * k
    for job in sorted(loads, key=lambda j: (-j.microbatches, -j.priority, j.name)):
        g = min(range(k), key=lambda i: (totals[i], i))
        groups[g].append(job)
        totals[g] += job.microbatches
    return [g for g in groups if g]


def group_microbatches(group: list[JobLoad]) -> int:
    """Microbatches a group-round packs into at least: ceil of the summed fractional loads."""
    return math.ceil(sum(j.microbatches for j in group) - 1e-9)


def stagger_ok(groups: list[list[JobLoad]], pipeline_depth: int, dp_size: int) -> bool:
    """Whether the other groups supply >= (S-1)·dp microbatches between two batches of each group."""
    need = (pipeline_depth - 1) * dp_size
    counts = [group_microbatches(g) for g in groups]
    return all(sum(counts) - c >= need for c in counts)


class AdapterGrouper:
    """Chooses groups once per planning call; the order of groups is the order in the stream."""

    def __init__(self, pipeline_depth: int, dp_size: int = 1, enabled: bool = True) -> None:
        self.pipeline_depth = pipeline_depth
        self.dp_size = dp_size
        self.enabled = enabled

    def group(self, loads: Mapping[str, float] | list[JobLoad]) -> list[list[str]]:
        """Groups of job names; within a group, jobs by priority (desc) then name."""
        jobs = [JobLoad(n, v) for n, v in loads.items()] if isinstance(loads, Mapping) else list(loads)
        if not jobs:
            return []
        if not self.enabled or self.pipeline_depth == 1 or len(jobs) == 1:
            chosen = [jobs]
        else:
            chosen = None
            for k in range(2, len(jobs) + 1):
                parts = lpt_partition(jobs, k)
                if stagger_ok(parts, self.pipeline_depth, self.dp_size):
                    chosen = parts
                    break
            if chosen is None:
                chosen = [[j] for j in sorted(jobs, key=lambda j: (-j.microbatches, -j.priority, j.name))]
        return [[j.name for j in sorted(g, key=lambda j: (-j.priority, j.name))] for g in chosen]
