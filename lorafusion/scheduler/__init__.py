"""lorafusion.scheduler — the CPU half of multi-adapter training (torch-free).

Turns N adapter jobs' data into packed microbatches that keep a 1F1B pipeline full and never break
an adapter's optimizer-step order (LoRAFusion §scheduling; tLoRA-style online jobs).

Contract with the runtime
-------------------------
Input
  * ``JobSpec`` per job: ``name``; ``global_batches`` — a sequence of global batches, each a list of
    ``(sample_id, num_tokens)`` (batch k has global-batch index ``first_batch_index + k``);
    ``global_batch_size``; optional ``priority`` (higher first), ``rank`` (LoRA r, scales the
    simulated cost per token), ``truncate`` (cut samples longer than the capacity instead of failing).
  * ``SchedulerConfig``: ``pipeline_depth`` S, ``dp_size``, ``token_capacity`` (an int: a
    run's ``auto`` is made a value by ``lorafusion.resolve``), ``milp_time_limit_s`` (MILP budget of
    one ``plan`` call), ``milp_gap``, ``grouping`` on/off, ``merge`` on/off, ``solver``
    (auto|cbc|highs|greedy), ``balance`` ("fill": full microbatches + one under-full tail per group,
    the default; "even": equal microbatches, lower pipeline bubble, more unused capacity).

Output: ``plan(jobs, config) -> Plan``
  * ``Plan.microbatches``: ordered by ``(slot, dp_rank)``; ``index`` = position in the list,
    ``slot = index // dp_size``, ``dp_rank = index % dp_size``. DP splits by slots: every slot holds
    exactly ``dp_size`` microbatches, one per rank, all ranks run slot t together; a rank runs
    ``plan.for_rank(r)`` through its 1F1B schedule.
  * ``Microbatch.entries``: ``Entry(job, batch, sample_id, num_tokens)`` in packing order, the entries
    of one job contiguous (``Microbatch.segments()`` gives ``(job, start, length)`` routing segments);
    ``is_noop`` marks an empty microbatch (a deliberate bubble).
  * ``Plan.last_microbatch[(job, batch)]``: index of the last microbatch holding that global batch;
    the job's gradients for it are complete, DP-reduced and its optimizer may step once that slot
    finished backward on stage 0 (``Plan.step_slot``).
  * Dependency rule (derived in ``verify``): ``first_slot(j, g+1) >= last_slot(j, g) + S``; with
    ``virtual_stages`` V > 1 (interleaved 1F1B) ``>= pipeorder.start_slot(last_slot(j, g), S, V)`` (about 2S
    apart), and a plan's slot count is padded with no-ops to a multiple of S (Megatron's microbatch groups).
  * ``verify_plan(plan, jobs, pipeline_depth, dp_size)`` raises ``PlanError`` naming job, batch and
    microbatch on any violation (dependency, capacity, contiguity, sample missing/duplicated) and
    returns a ``VerifyReport`` (no-op count, slots, samples, minimum gap per job). Call it on every plan.
  * A sample longer than the capacity raises ``SampleTooLongError`` naming job, batch and sample id,
    unless its job has ``truncate=True`` (then ``num_tokens`` is the capacity).
  * Continuing plans: pass ``initial_ready`` (or use ``OnlineScheduler``, which carries it and lets
    jobs join/leave between global batches without changing plans already returned).

Pieces: ``AdapterGrouper`` (grouper), ``DataBatcher`` (batcher: PuLP MILP, greedy FFD warm start and
fallback), ``merge_tails`` (merge), ``sequence``/``verify_plan`` (verify), ``simulate_1f1b`` /
``simulate_plan`` (simulate), ``render_gantt`` / ``render_packing`` / ``render_chunks`` (charts),
``CostModel`` / ``fit_cost_model`` / ``auto_token_capacity`` (costmodel), ``OnlineScheduler`` (online),
``stage_order`` / ``start_slot`` (pipeorder: Megatron's 1F1B and interleaved op orders, the dependency rule
they imply), ``stages`` (stage splits: the output layer and loss as work, ``stage_layers: auto``, a FLOP cost
model); for evaluation,
``lorafusion.scheduler.trace`` (arrival traces of jobs: read, validate, generate) and
``lorafusion.scheduler.replay`` (a trace under sequential FIFO, static batching and online policies).
"""

from .batcher import DataBatcher, PackResult, first_fit_decreasing, greedy_pack, lower_bound, pack_objective
from .costmodel import CostModel, auto_token_capacity, fit_cost_model
from .grouper import AdapterGrouper, JobLoad
from .merge import merge_tails
from .online import JobReport, OnlineScheduler, concat_plans
from .planner import plan
from .charts import render_chunks, render_gantt, render_packing
from .simulate import (
    Timeline,
    bubble_ratio,
    job_spans,
    simulate_1f1b,
    simulate_plan,
)
from .spec import (
    Entry,
    JobSpec,
    Microbatch,
    Plan,
    PlanError,
    PlanStats,
    SampleTooLongError,
    SchedulerConfig,
)
from .pipeorder import dependency_distance, p2p_order, stage_order, start_slot
from .verify import PackedMicrobatch, VerifyReport, sequence, verify_plan

__all__ = [
    "AdapterGrouper",
    "CostModel",
    "DataBatcher",
    "Entry",
    "JobLoad",
    "JobReport",
    "JobSpec",
    "Microbatch",
    "OnlineScheduler",
    "PackResult",
    "PackedMicrobatch",
    "Plan",
    "PlanError",
    "PlanStats",
    "SampleTooLongError",
    "SchedulerConfig",
    "Timeline",
    "VerifyReport",
    "auto_token_capacity",
    "bubble_ratio",
    "concat_plans",
    "dependency_distance",
    "first_fit_decreasing",
    "fit_cost_model",
    "greedy_pack",
    "job_spans",
    "lower_bound",
    "merge_tails",
    "pack_objective",
    "plan",
    "render_chunks",
    "render_gantt",
    "render_packing",
    "sequence",
    "p2p_order",
    "stage_order",
    "start_slot",
    "simulate_1f1b",
    "simulate_plan",
    "verify_plan",
]
