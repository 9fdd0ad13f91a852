"""Data types of the scheduler: jobs in, plan out (see the package docstring for the contract)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lorafusion.core.errors import UserError
from lorafusion.core.pipeline import virtual_stages_problem

from .policy import POLICIES, Policy

SampleId = Hashable
GlobalBatch = Sequence[tuple[SampleId, int]]


class PlanError(ValueError):
    """A job, configuration or plan breaks the scheduler contract (the message names what and where)."""


class SampleTooLongError(PlanError, UserError):
    """A sample has more tokens than the microbatch token capacity and its job does not truncate (the
    user's data or settings; other PlanErrors break the contract inside the program)."""


@dataclass(frozen=True)
class JobSpec:
    """One adapter job as the scheduler sees it.

    ``global_batches[k]`` is the job's global batch number ``first_batch_index + k``: a list of
    ``(sample_id, num_tokens)``. ``global_batch_size`` is the number of samples per optimizer step
    (checked against every batch except a shorter final one). ``rank`` (LoRA r) only scales the
    simulated cost per token; ``priority`` (higher first) orders jobs inside groups and microbatches.
    ``truncate``: a sample longer than the capacity is cut to the capacity instead of raising.
    """

    name: str
    global_batches: Sequence[GlobalBatch]
    global_batch_size: int
    priority: int = 0
    rank: int = 16
    truncate: bool = False
    first_batch_index: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise PlanError("job name must be non-empty")
        if self.global_batch_size <= 0:
            raise PlanError(f"job {self.name!r}: global_batch_size must be positive")
        for k, batch in enumerate(self.global_batches):
            last = k == len(self.global_batches) - 1
            if len(batch) == 0 or len(batch) > self.global_batch_size or (
                not last and len(batch) != self.global_batch_size
            ):
                raise PlanError(
                    f"job {self.name!r}: global batch {self.first_batch_index + k} has {len(batch)} samples, "
                    f"global_batch_size is {self.global_batch_size}"
                )


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of planning. The first block are the run YAML's ``parallelism`` (``pp``, ``dp``) and
    ``scheduler`` fields, with the YAML's names and defaults (``lookahead_batches``: global batches of
    every job per planned chunk, used by the runtime's feed); the rest are not in the YAML."""

    pipeline_depth: int = 1
    dp_size: int = 1
    # tokens a microbatch ("auto" in the YAML is made a value by lorafusion.resolve)
    token_capacity: int = 4096
    milp_time_limit_s: float = 1.0
    grouping: bool = True
    lookahead_batches: int = 2
    policy: Policy = "together"  # whose batches a chunk holds: policy.py
    merge: bool = True
    balance: Literal["fill", "even"] = "fill"  # see batcher: full bins + tail, or equal bins
    solver: Literal["auto", "cbc", "highs", "greedy"] = "auto"
    # pending microbatches the no-op sequencer looks at; None -> 2*S*dp + 4
    sequencer_window: int | None = None
    max_milp_vars: int = 3000  # bigger instances are improved on a neighbourhood of the greedy plan
    milp_gap: float = 0.01  # relative optimality gap of the balance MILP (0: solve to optimality)
    virtual_stages: int = 1  # parallelism.virtual_stages: model chunks per pipeline rank (interleaved 1F1B)

    def __post_init__(self) -> None:
        if self.pipeline_depth < 1 or self.dp_size < 1:
            raise PlanError("pipeline_depth and dp_size must be >= 1")
        if why := virtual_stages_problem(self.pipeline_depth, self.virtual_stages):
            raise PlanError(f"virtual_stages: {why} (pipeline_depth {self.pipeline_depth})")
        if isinstance(self.token_capacity, bool) or not isinstance(self.token_capacity,
                                                                   int) or self.token_capacity < 1:
            raise PlanError(f"token_capacity must be a positive int, got {self.token_capacity!r}")
        if self.balance not in ("fill", "even"):
            raise PlanError(f"balance must be 'fill' or 'even', got {self.balance!r}")
        if self.policy not in POLICIES:
            raise PlanError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {self.policy!r}")
        if self.lookahead_batches < 1:
            raise PlanError("lookahead_batches must be >= 1")
        if self.milp_time_limit_s < 0:
            raise PlanError("milp_time_limit_s must be >= 0")


@dataclass(frozen=True)
class Entry:
    """One sample inside a microbatch; ``batch`` is the job's global batch index."""

    job: str
    batch: int
    sample_id: SampleId
    num_tokens: int


@dataclass(frozen=True)
class Microbatch:
    """One pipeline microbatch on one data-parallel rank.

    ``index`` is the position in ``Plan.microbatches``; ``slot`` is the pipeline position on its rank
    (all ranks run slot t at the same time); entries are in packing order, one job's entries contiguous.
    A no-op microbatch has no entries: the rank runs an empty microbatch (a bubble) in that slot.
    ``group`` is the AdapterGrouper group the entries came from (-1 for no-ops, -2 for merged groups).
    """

    index: int
    slot: int
    dp_rank: int
    entries: tuple[Entry, ...]
    is_noop: bool = False
    group: int = -1

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def jobs(self) -> tuple[str, ...]:
        """Jobs in packing order (each once)."""
        return tuple(dict.fromkeys(e.job for e in self.entries))

    def segments(self) -> list[tuple[str, int, int]]:
        """Contiguous per-job token segments ``(job, start, length)`` for adapter routing."""
        out: list[tuple[str, int, int]] = []
        pos = 0
        for e in self.entries:
            if out and out[-1][0] == e.job:
                job, start, length = out[-1]
                out[-1] = (job, start, length + e.num_tokens)
            else:
                out.append((e.job, pos, e.num_tokens))
            pos += e.num_tokens
        return out


@dataclass
class PlanStats:
    """How the plan was made (for logs and benchmarks; not part of the correctness contract)."""

    plan_s: float = 0.0
    num_noops: int = 0
    groups: list[list[str]] = field(default_factory=list)
    pack_sources: dict[str, int] = field(default_factory=dict)  # "greedy" / "milp" -> count of packings
    merges: int = 0


@dataclass
class Plan:
    """An ordered list of microbatches, sorted by ``(slot, dp_rank)``; every slot has ``dp_size`` of them.

    ``last_microbatch[(job, batch)]``: index of the last microbatch holding that global batch; its
    optimizer may step once that microbatch (its whole slot, all DP ranks) has finished backward.
    ``initial_ready[job]``: first slot at which this plan may start the job's first batch (carried
    from earlier plans in online mode; 0 when absent). ``virtual_stages``: model chunks per pipeline rank
    the plan was made for (interleaved 1F1B when > 1; its slot count is then a multiple of the depth).
    """

    microbatches: list[Microbatch]
    pipeline_depth: int
    dp_size: int
    token_capacity: int
    last_microbatch: dict[tuple[str, int], int]
    initial_ready: dict[str, int] = field(default_factory=dict)
    stats: PlanStats = field(default_factory=PlanStats)
    virtual_stages: int = 1

    @property
    def num_slots(self) -> int:
        return 0 if not self.microbatches else self.microbatches[-1].slot + 1

    @property
    def num_noops(self) -> int:
        return sum(mb.is_noop for mb in self.microbatches)

    def step_slot(self, job: str, batch: int) -> int:
        """Slot after whose backward the job's optimizer steps for ``batch``."""
        return self.microbatches[self.last_microbatch[(job, batch)]].slot

    def for_rank(self, dp_rank: int) -> list[Microbatch]:
        """This rank's microbatches in slot order (what one rank's 1F1B schedule runs)."""
        return [mb for mb in self.microbatches if mb.dp_rank == dp_rank]
