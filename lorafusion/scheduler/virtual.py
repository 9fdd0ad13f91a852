"""``parallelism.virtual_stages: auto``: each candidate V's predicted time per token, from the pipeline
simulator on a chunk planned as the run would plan it (torch-free; ``lorafusion.resolve`` chooses).

No data is read: each job's chunk (``lookahead_batches`` global batches) holds samples whose lengths are
spread evenly over (0, ``dataset.max_seq_len``] (half of it on average, as the memory plan's chunk estimate
assumes), each global batch over the whole range. The scheduler plans that chunk at V (the capacity the
memory plan chose at V, the dependency distance V implies and Megatron's no-op padding; the greedy packer, no
MILP time) and :func:`.simulate.simulate_plan` runs it: each microbatch's whole-model forward from FLOPs
(:func:`.stages.flop_cost_model`: the linears per token, causal attention per sample², so microbatches of
unequal work take unequal time), each virtual stage's share of it (its decoder layers; the output layer and
loss on the last), each recomputed layer's cost in its virtual stage's backward
(:func:`.stages.recompute_stage_costs`, the recompute the memory plan forces at V), ``P2P_S`` per hand-over
between ranks and ``OP_S`` of fixed work per op (a microbatch's forward or backward on one model chunk: the
host's schedule step, p2p calls and launches, which V multiplies). The predicted time per token is the
slowest DP rank's makespan over the chunk's tokens: fill and drain, unequal microbatches, no-ops, recompute
and the per-op work in one number.

``OP_S`` is one fit to one measurement (the 8B shape on 2x H200, where the GPU waits for the host): on a GPU
that the host keeps busier, or a larger model, each op's fixed work weighs less and a larger V pays sooner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lorafusion.core.arch import ModelArch

from .planner import plan
from .simulate import simulate_plan
from .spec import JobSpec, SchedulerConfig
from .stagecost import bf16_leading
from .stages import embedding_layers, flop_cost_model, loss_layers, recompute_stage_costs

__all__ = ["BACKWARD_RATIO", "P2P_S", "Candidate", "VirtualChoice", "VirtualScore", "candidate",
           "choose_virtual", "score_virtual", "synthetic_jobs"]

BACKWARD_RATIO = 2.0  # the simulator's backward over forward (scripts/sim_interleave.py's calibration)
P2P_S = 2.0e-4  # one hand-over between ranks: a 4096 x 8192 bf16 activation (64 MiB) over NVLink
# fixed work per op (a microbatch's forward or backward on one model chunk) on its rank, in simulated seconds:
# fitted to the 8B shape at PP=2, capacity 4096, on 2x H200, where V=2 ran at 19,153 tokens/s and V=1 at
# 22,068 (1.152x the time per token, while the simulator without it predicts them equal): with it the
# simulated rates are 21,200 and 24,400 tokens/s. Measured while each p2p call still exchanged its shapes with
# the peer.
OP_S = 0.0125


@dataclass(frozen=True)
class VirtualScore:
    """The simulated chunk of one V: ``time_per_token`` (simulated seconds, lower is better), its bubble,
    microbatches per DP rank and the no-ops among them, and its tokens."""

    virtual_stages: int
    time_per_token: float
    bubble: float
    microbatches: int
    noops: int
    tokens: int


def synthetic_jobs(jobs: Sequence[tuple[str, int, int]], lookahead: int) -> list[JobSpec]:
    """Per ``(name, global_batch_size, max_seq_len)``: ``lookahead`` global batches whose sample lengths are
    spread evenly over (0, max_seq_len], global batch b taking every ``lookahead``-th length from the b-th."""
    out = []
    for name, gbs, longest in jobs:
        n = gbs * lookahead
        lengths = [max(1, round(longest * (2 * i + 1) / (2 * n))) for i in range(n)]
        batches = [[(b + lookahead * k, lengths[b + lookahead * k]) for k in range(gbs)]
                   for b in range(lookahead)]
        out.append(JobSpec(name, batches, gbs, truncate=True))
    return out


def score_virtual(jobs: Sequence[JobSpec], config: SchedulerConfig, arch: ModelArch, split: Sequence[int],
                  recompute_per_chunk: Sequence[int], tp: int = 1, op_s: float | None = None,
                  bf16_leading: int | None = None) -> VirtualScore:
    """The simulated chunk of ``jobs`` planned with ``config`` (its ``virtual_stages`` V and capacity) on
    ``split`` (decoder layers per virtual stage, layer order) with ``recompute_per_chunk`` (per pipeline rank:
    recomputed layers of each of its model chunks); ``bf16_leading``: an FP8 base's leading bf16 layers
    (None: a bf16 base). The stages' shares come from the fitted stage cost model (:mod:`.stagecost`)."""
    the_plan = plan(jobs, replace(config, solver="greedy", milp_time_limit_s=0.0))
    loss = loss_layers(arch)
    costs = recompute_stage_costs(split, loss, config.pipeline_depth, recompute_per_chunk, BACKWARD_RATIO,
                                  bf16_leading, embedding_layers())
    timelines = simulate_plan(the_plan, flop_cost_model(arch, loss, tp=tp), backward_ratio=BACKWARD_RATIO,
                              p2p_s=P2P_S, stage_costs=costs, op_s=OP_S if op_s is None else op_s)
    span = max(t.makespan for t in timelines)
    tokens = sum(mb.num_tokens for mb in the_plan.microbatches)
    busy = sum(sum(t.busy) for t in timelines)
    bubble = 1.0 - busy / (span * config.pipeline_depth * len(timelines)) if span > 0 else 0.0
    return VirtualScore(config.virtual_stages, span / max(1, tokens), bubble, the_plan.num_slots,
                        sum(mb.is_noop for mb in the_plan.for_rank(0)), tokens)


@dataclass(frozen=True)
class Candidate:
    """One V as the run would resolve it: whether it fits the GPU's memory, its token capacity and recompute
    per rank (the memory plan's at V), and its simulated chunk (None where it does not fit)."""

    virtual_stages: int
    fits: bool
    token_capacity: int
    recompute_layers: tuple[int, ...]
    score: VirtualScore | None


@dataclass(frozen=True)
class VirtualChoice:
    """``virtual_stages: auto`` decided: the V chosen and every candidate, or the one reason there was no
    choice (``reason``: e.g. no pipeline)."""

    chosen: int
    candidates: tuple[Candidate, ...] = ()
    reason: str = ""

    def _best(self) -> Candidate | None:
        return next((c for c in self.candidates if c.virtual_stages == self.chosen), None)

    def lines(self) -> list[str]:
        """The choice and the alternatives it beat, with their predicted time relative to it."""
        best = self._best()
        if self.reason or best is None or best.score is None:
            return [f"virtual_stages {self.chosen} (auto): {self.reason or 'nothing fits'}"]
        out = [f"virtual_stages {self.chosen} (auto): the fastest by the pipeline simulator (a chunk planned "
               f"at each V with its capacity and recompute: fill and drain, unequal microbatches, no-ops, "
               f"recompute, per-op work): simulated bubble {best.score.bubble:.3f}, {best.score.noops} "
               f"no-op(s) in {best.score.microbatches} microbatches"]
        for c in self.candidates:
            if c is best:
                continue
            what = ("does not fit" if not c.fits or c.score is None else
                    f"{c.score.time_per_token / best.score.time_per_token:.3f}x the time per token, bubble "
                    f"{c.score.bubble:.3f}, {c.score.noops} no-op(s)")
            out.append(f"  virtual_stages {c.virtual_stages} (token_capacity {c.token_capacity}, "
                       f"recompute_layers {list(c.recompute_layers)}): {what}")
        return out

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "reason": self.reason or None, "candidates": [
            {"virtual_stages": c.virtual_stages, "fits": c.fits, "token_capacity": c.token_capacity,
             "recompute_layers": list(c.recompute_layers),
             "predicted_time_per_token": None if c.score is None else c.score.time_per_token,
             "simulated_bubble": None if c.score is None else round(c.score.bubble, 4),
             "noops": None if c.score is None else c.score.noops} for c in self.candidates]}


def candidate(run_plan, arch: ModelArch, jobs: Sequence[JobSpec]) -> Candidate:
    """The :class:`Candidate` of a run resolved at one V (a ``lorafusion.resolve.RunPlan``: its
    ``virtual_stages``, ``fits``, ``token_capacity``, ``recompute_layers``, ``recompute`` (per rank the model
    builder's (on, layers per chunk; None: all)), ``scheduler``, ``stage_layers`` and ``tp``), its chunk of
    ``jobs`` simulated where it fits."""
    q, split = run_plan, list(run_plan.stage_layers)
    per_chunk = [0 if not on else max(split) if n is None else n for on, n in q.recompute]
    lead = bf16_leading(q.setup)
    score = (score_virtual(jobs, q.scheduler, arch, split, per_chunk, q.tp, bf16_leading=lead)
             if q.fits else None)
    return Candidate(q.virtual_stages, q.fits, q.token_capacity, tuple(q.recompute_layers), score)


def choose_virtual(candidates: Sequence[Candidate]) -> VirtualChoice:
    """The candidate of least predicted time per token among those that fit (ties: the smaller V); where none
    fits, the smallest V (its plan says why it does not fit)."""
    scored = [c for c in candidates if c.fits and c.score is not None]
    if not scored:
        return VirtualChoice(min(c.virtual_stages for c in candidates), tuple(candidates))
    best = min(scored, key=lambda c: (c.score.time_per_token, c.virtual_stages))
    return VirtualChoice(best.virtual_stages, tuple(candidates))
