"""The op order of Megatron-core's pipeline schedules, and the dependency rule it implies (torch-free).

1F1B (``V = 1``, ``forward_backward_pipelining_without_interleaving``): stage s runs ``S-1-s`` warm-up
forwards, then alternates ``F(t), B(t-(S-1-s))``, then drains the backwards.

Interleaved 1F1B (``V > 1`` model chunks per rank, ``forward_backward_pipelining_with_interleaving``,
Megatron's ``virtual_pipeline_model_parallel_size``): virtual stage ``k = c·S + r`` (layers in order) is
model chunk c of rank r. Microbatches go in groups of ``G = S`` (Megatron's default
``microbatch_group_size_per_vp_stage``); the schedule table visits, group by group, chunk 0 of the group's
microbatches, then chunk 1, ... (``get_schedule_table``). Rank r runs ``w_r = 2(S-1-r) + (V-1)G`` warm-up
forwards of the table, then alternates forward ``w_r + t`` / backward ``t`` of the table (a backward visits
the chunks in reverse, ``V-1-c``), then drains. Megatron needs the microbatch count to be a multiple of
``G`` (and at least ``G``); the planner pads a plan with no-op slots to that (:func:`interleave_padding`).

Dependency rule: job j's optimizer may step for global batch g once every backward of g is done on every
rank; on rank r the last is chunk 0's backward of L = last_slot(j, g) (a microbatch's backwards run chunk
V-1 down to 0, and chunk 0's backwards run in microbatch order). The forward of batch g+1 first touches rank
r at chunk 0. So a microbatch u may hold batch g+1 only if on every rank r chunk 0's ``B(L)`` comes before
chunk 0's ``F(u)`` in the rank's op order: :func:`start_slot` gives the first such u. The order is fixed by
the schedule, so the rule does not depend on microbatch durations. With V = 1 it is ``u >= L + S``.
"""

from __future__ import annotations

from functools import lru_cache

from .spec import PlanError

Op = tuple[str, int, int]  # (kind "F" | "B", microbatch, model chunk)


def schedule_table(num_microbatches: int, virtual_stages: int, group: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: (microbatch, chunk) of every virtual microbatch, in order."""
    table = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table += [(u, c) for c in range(virtual_stages) for u in range(lo, hi)]
    return table


def warmup(pipeline_depth: int, stage: int, virtual_stages: int) -> int:
    """Warm-up forwards of rank ``stage`` (before the cap at the total op count)."""
    if virtual_stages == 1:
        return pipeline_depth - 1 - stage
    return 2 * (pipeline_depth - 1 - stage) + (virtual_stages - 1) * pipeline_depth


def stage_order(pipeline_depth: int, stage: int, num_microbatches: int, virtual_stages: int = 1) -> list[Op]:
    """The ops of rank ``stage`` in the order Megatron runs them."""
    S, V, m = pipeline_depth, virtual_stages, num_microbatches
    table = schedule_table(m, V, S) if V > 1 else [(u, 0) for u in range(m)]
    total = len(table)
    w = min(warmup(S, stage, V), total)
    fwd = [("F", u, c) for u, c in table]
    bwd = [("B", u, V - 1 - c) for u, c in table]
    order = fwd[:w]
    for t in range(total - w):
        order += [fwd[w + t], bwd[t]]
    return order + bwd[total - w:]


def _f_index(u: int, S: int, V: int) -> int:
    """Virtual index of chunk 0's forward of microbatch u (unbounded table, groups of S)."""
    return V * S * (u // S) + u % S


def _b_index(u: int, S: int, V: int) -> int:
    """Virtual index of chunk 0's backward of microbatch u (table entry (u, V-1))."""
    return V * S * (u // S) + (V - 1) * S + u % S


@lru_cache(maxsize=4096)
def start_slot(last: int, pipeline_depth: int, virtual_stages: int = 1) -> int:
    """First slot a microbatch of a job's next global batch may take when its batch ends at slot ``last``.

    On rank r the forward of virtual index k (k >= w_r) runs right after the backward of k - w_r - 1 and
    before that of k - w_r, so chunk 0's ``B(last)`` precedes chunk 0's ``F(u)`` iff
    ``b(last) < f(u) - w_r``. Exact for any plan whose slot count is a multiple of S (the padded plans):
    the table's prefix is then the unbounded table's and a forward in the warm-up never follows a backward.
    """
    S, V = pipeline_depth, virtual_stages
    if V == 1:
        return last + S
    need = max(_b_index(last, S, V) + warmup(S, r, V) for r in range(S))
    u = last + 1
    while _f_index(u, S, V) <= need:
        u += 1
    return u


def dependency_distance(pipeline_depth: int, virtual_stages: int = 1) -> int:
    """Largest ``start_slot(L) - L`` over L: a slot distance that satisfies the rule wherever a batch ends
    (``S`` for 1F1B). The sequencer keeps it; :func:`start_slot` is the exact rule verify checks."""
    return max(start_slot(last, pipeline_depth, virtual_stages) - last
               for last in range(pipeline_depth))


def interleave_padding(num_slots: int, pipeline_depth: int, virtual_stages: int) -> int:
    """No-op slots to append so Megatron's interleaved schedule takes the plan: the microbatch count a
    multiple of the group size S and at least S (0 with V = 1 or an empty plan)."""
    if virtual_stages == 1 or num_slots == 0:
        return 0
    return max(pipeline_depth, -(-num_slots // pipeline_depth) * pipeline_depth) - num_slots


def check_slot_count(num_slots: int, pipeline_depth: int, virtual_stages: int) -> None:
    if virtual_stages > 1 and num_slots and interleave_padding(num_slots, pipeline_depth, virtual_stages):
        raise PlanError(
            f"interleaved 1F1B (pp={pipeline_depth}, virtual_stages={virtual_stages}) runs a multiple of "
            f"pp microbatches per rank (Megatron's microbatch groups), the plan has {num_slots}")


def p2p_order(pipeline_depth: int, stage: int, num_microbatches: int, virtual_stages: int = 1, *,
              forward_only: bool = False, group: int | None = None) -> dict[str, list[tuple[int, int]]]:
    """The (microbatch, model chunk) of every tensor rank ``stage`` sends and receives in Megatron's pipeline
    p2p, per channel in the order the schedule issues them: ``recv_prev`` (the activations of its forwards
    from the previous rank), ``send_next`` (its forwards' outputs), ``recv_next`` (the gradients of its
    backwards' outputs from the next rank), ``send_prev`` (its backwards' input gradients). Each channel
    follows the forward (or backward) order of the schedule table, which every rank shares; only the first
    virtual stage (rank 0, chunk 0) receives no activation and sends no gradient, and only the last (rank
    S-1, chunk V-1) sends no activation and receives no gradient. ``group``: Megatron's
    ``microbatch_group_size_per_vp_stage`` (default S)."""
    S, V, m = pipeline_depth, virtual_stages, num_microbatches
    table = schedule_table(m, V, group or S) if V > 1 else [(u, 0) for u in range(m)]
    first = [(u, c) for u, c in table if not (stage == 0 and c == 0)]
    last = [(u, c) for u, c in table if not (stage == S - 1 and c == V - 1)]
    backward = [(u, V - 1 - c) for u, c in table]
    out = {"recv_prev": first, "send_next": last, "recv_next": [], "send_prev": []}
    if not forward_only:
        out["recv_next"] = [(u, c) for u, c in backward if not (stage == S - 1 and c == V - 1)]
        out["send_prev"] = [(u, c) for u, c in backward if not (stage == 0 and c == 0)]
    if S == 1:
        out = {k: [] for k in out}
    return out
