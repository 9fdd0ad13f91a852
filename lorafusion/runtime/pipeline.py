"""One planned chunk through Megatron-core's schedule (1F1B when PP > 1), with each job's optimizer
stepping inside the pipeline.

Loss: each microbatch returns ``Σ_jobs (token-loss sum of the job's tokens in it) / (job's loss tokens in
its whole global batch)``, so the accumulated gradient of every adapter is exactly the token-mean
gradient of its global batch, as if trained alone. Dropout masks are keyed by (run seed, job, global
batch index, layer) and per row by (sample id, position), so they depend neither on packing nor on the
other jobs.

Steps: on stage s of S, 1F1B runs the backward of slot t before the forward of slot t + S - s. So when
the forward of slot u is about to run, every (job, batch) whose last slot L has L + S - s <= u has
finished backward on this stage: its step *begins* (DP reduction, async norm reduction). It *ends*
(clip + AdamW) right before this stage's first forward that uses the job again, which the scheduler's
dependency rule (first_slot(g+1) >= L + S) places after the beginning; at the latest when the
pipeline has drained. :class:`StepTracker` keeps that bookkeeping.

Interleaved 1F1B (``parallelism.virtual_stages`` V > 1: this rank holds V model chunks): a microbatch's last
backward on this rank is chunk 0's and its first forward is chunk 0's, in the order
:func:`lorafusion.scheduler.pipeorder.stage_order` gives. A step *begins* right after chunk 0's backward of
the batch's last microbatch (a hook after each of Megatron's backward steps, before the gradient is sent on,
so every rank has begun before the first rank waits in an *end*), and *ends* right before chunk 0's forward of
the job's next microbatch here; the scheduler's rule (``pipeorder.start_slot``) puts that forward after the
backward on every rank. :class:`InterleavedStepTracker`.

No host waits for the GPU inside the schedule. On NCCL a pair of pipeline ranks runs its p2p operations in
issue order on one stream, and a send finishes only once the peer has posted its receive (in its own p2p
call; the shapes come from the plan, :func:`p2p_shapes`, never from the peer). A host that waits for its
GPU (``.tolist()`` of a device tensor, a blocking copy) while the compute stream waits for such a send, a
receive behind it, or an *end*'s norm all-reduce can stop the very p2p call its peer's host is waiting in:
a deadlock that gloo, whose sends finish alone, never shows (tests/runtime/test_schedule_device_reads.py).
``LORAFUSION_SYNC_DEBUG`` reports such waits on a GPU; ``LORAFUSION_PIPELINE_TRACE`` records each rank's
schedule position (:mod:`megatron_patches.trace`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_patches.trace import record
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.dist import multi_process
from lorafusion.data.packing import pad_to_multiple
from lorafusion.runtime.feed import Chunk, Key
from lorafusion.scheduler import Plan, p2p_order, stage_order


class StepTracker:
    """When each (job, global batch) of a plan begins and ends its optimizer step on one stage."""

    def __init__(self, plan: Plan, optimizers: dict, stage: int, num_stages: int):
        self.optimizers = optimizers  # job name -> AdapterOptimizer
        self.keys: list[Key] = sorted(plan.last_microbatch, key=lambda k: (plan.step_slot(*k), k))
        self._begin_at = {k: plan.step_slot(*k) + num_stages - stage for k in self.keys}
        self._begun: list[Key] = []
        self.results: dict[Key, tuple] = {}  # (grad norm as a device scalar, lr) of each finished step
        self._next_slot = 0

    def before_forward(self, jobs: Iterable[str]) -> None:
        """Call right before each forward, in slot order, with the jobs of that microbatch."""
        self._begin(upto=self._next_slot)
        self._next_slot += 1
        self._end(set(jobs))

    def finish(self) -> dict[Key, tuple]:
        """The pipeline has drained (every backward is done): begin and end every remaining step."""
        self._begin(upto=None)
        self._end(None)
        return self.results

    def _begin(self, upto: int | None) -> None:
        for k in self.keys:
            if k not in self._begun and (upto is None or self._begin_at[k] <= upto):
                # A DP rank that ran no microbatch of the job since its previous step began has not ended
                # that step yet (it ends before the job's next forward on this rank): end it now, so its
                # gradients (zeros, or this rank's share) join this step's reduction in lockstep with the
                # ranks that did run the job.
                self._end({k[0]})
                record(f"optimizer step begins {k}")
                self.optimizers[k[0]].begin_step()
                self._begun.append(k)

    def _end(self, jobs: set[str] | None) -> None:
        for k in self._begun:
            if k not in self.results and (jobs is None or k[0] in jobs):
                record(f"optimizer step ends {k}")
                self.results[k] = self.optimizers[k[0]].end_step()


class InterleavedStepTracker(StepTracker):
    """:class:`StepTracker` for interleaved 1F1B: steps begin after chunk 0's backward of a batch's last
    microbatch (:meth:`after_backward`, called after every backward in order) and end before chunk 0's forward
    of the job's next microbatch (:meth:`before_forward` with the chunk)."""

    def __init__(self, plan: Plan, optimizers: dict, stage: int, num_stages: int, virtual_stages: int,
                 num_microbatches: int):
        super().__init__(plan, optimizers, stage, num_stages)
        order = stage_order(num_stages, stage, num_microbatches, virtual_stages)
        self._backwards = [(u, c) for kind, u, c in order if kind == "B"]
        self._done = 0
        self._ends_at: dict[int, list[Key]] = {}
        for k in self.keys:
            self._ends_at.setdefault(plan.step_slot(*k), []).append(k)
        self._ends_at_key = set(self.keys)

    def after_backward(self) -> None:
        u, c = self._backwards[self._done]
        self._done += 1
        if c != 0:
            return
        for k in self._ends_at.get(u, ()):
            if k not in self._begun:
                self._end({k[0]})  # a DP rank that skipped the job: see StepTracker._begin
                record(f"optimizer step begins {k}")
                self.optimizers[k[0]].begin_step()
                self._begun.append(k)

    def before_forward(self, batch_of: dict[str, int], chunk: int = 0) -> None:
        """Before each forward, with the microbatch's {job: global batch}: chunk 0 ends the steps it needs;
        a job whose previous batch has not begun its step here would train on stale gradients (the plan broke
        the dependency rule): an error, never silently wrong."""
        if chunk != 0:
            return
        for job, g in batch_of.items():
            if (job, g - 1) in self._ends_at_key and (job, g - 1) not in self._begun:
                raise RuntimeError(f"dependency rule broken: job {job!r} batch {g} reaches chunk 0 before "
                                   f"batch {g - 1} finished its backward on this rank")
        self._end(set(batch_of))

    def finish(self) -> dict[Key, tuple]:
        if self._done != len(self._backwards):
            raise RuntimeError(f"interleaved 1F1B ran {self._done} backward steps, its order has "
                               f"{len(self._backwards)}")
        return super().finish()


def chunks_of(model) -> list:
    """The model chunks Megatron's schedule takes: this rank's V chunks, or ``[model]``."""
    return list(model) if isinstance(model, torch.nn.ModuleList) else [model]


def make_tracker(chunk: Chunk, optimizers: dict, virtual_stages: int) -> StepTracker:
    from megatron.core import parallel_state

    num_stages = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if virtual_stages > 1:
        return InterleavedStepTracker(chunk.plan, optimizers, stage, num_stages, virtual_stages,
                                      len(chunk.packed))
    return StepTracker(chunk.plan, optimizers, stage, num_stages)


def dropout_seed(run_seed: int, job: str, batch: int) -> int:
    return mix_seed(run_seed, name_key(job), batch)


# ------------------------------------------------- the plumbing a training chunk and an evaluation share
def sp_pad(model) -> int:
    """Sequence parallelism splits each microbatch's tokens over the TP ranks: they are padded to a multiple
    of tp (1 without it)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1


def forward_packed(model_, batch, pad: int, dev, seeds=None):
    """One packed microbatch through the model, its LoRA routing set (``seeds``: the adapters' dropout seeds).
    Returns (per-token loss output, the batch on the device)."""
    from lorafusion.layers import set_batch

    batch = pad_to_multiple(batch, pad).to(dev)
    if seeds is None:
        set_batch(model_, batch.routing, batch.adapters)
    else:
        set_batch(model_, batch.routing, batch.adapters, seeds)
    output = model_(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                    packed_seq_params=batch.packed_seq_params())
    return output, batch


def segments(per_token, batch):
    """(adapter name, its masked per-token losses, its loss mask) per routing segment of ``batch``: slices of
    the device tensor, no host masks; and the masked losses of the whole microbatch."""
    counted = per_token.float().reshape(-1) * batch.loss_mask.reshape(-1)
    mask = batch.loss_mask.reshape(-1)
    parts = [(batch.adapters[slot], counted[start:start + length], mask[start:start + length])
             for slot, start, length in batch.routing.segments]
    return parts, counted


def run_schedule(chunks: list, forward_step, microbatches: list, num_tokens, pad: int, *,
                 forward_only: bool) -> None:
    """Megatron's schedule (1F1B when PP > 1, interleaved over the model's ``chunks`` when there are several:
    one iterator per chunk over the same microbatches) over ``microbatches`` (``num_tokens(mb)``: its token
    count)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patches import local_p2p_shapes
    from megatron_patches.trace import traced_schedule

    data = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    record(f"schedule begin: {len(microbatches)} microbatches, {len(chunks)} model chunk(s), "
           f"forward_only={forward_only}")
    shapes = p2p_shapes(chunks, microbatches, num_tokens, pad, forward_only=forward_only)
    with traced_schedule(), sync_debug(), local_p2p_shapes(shapes):
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                    num_microbatches=len(microbatches),
                                    seq_length=max(-(-num_tokens(b) // pad) * pad for b in microbatches),
                                    micro_batch_size=1, forward_only=forward_only)
    record("schedule end")


def p2p_shapes(chunks: list, microbatches: list, num_tokens, pad: int, *, forward_only: bool) -> dict:
    """The shape of every tensor this rank's pipeline p2p sends and receives in the schedule, per channel in
    the order Megatron issues them (``megatron_patches.local_p2p_shapes``; nothing is exchanged with the
    peers): a microbatch's hidden states or their gradient, [its tokens padded to ``pad``, over tp under
    sequence parallelism; 1; hidden]. The plan, and so every microbatch's token count, is the same on the
    ranks of a pipeline."""
    from megatron.core import parallel_state as ps

    depth = ps.get_pipeline_model_parallel_world_size()
    if depth == 1:
        return {}
    config = chunks[0].config
    split = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    rows = [-(-num_tokens(b) // pad) * pad // split for b in microbatches]
    group = getattr(config, "microbatch_group_size_per_vp_stage", None)
    order = p2p_order(depth, ps.get_pipeline_model_parallel_rank(), len(microbatches), len(chunks),
                      forward_only=forward_only, group=group)
    return {channel: [((rows[u], 1, config.hidden_size), f"microbatch {u} (model chunk {c})") for u, c in ops]
            for channel, ops in order.items()}


SYNC_DEBUG_ENV = "LORAFUSION_SYNC_DEBUG"


@contextlib.contextmanager
def sync_debug():
    """On a GPU with ``LORAFUSION_SYNC_DEBUG`` = warn or error: torch's sync debug mode while the schedule
    runs, so every call that makes the host wait for the GPU (``.item()``, ``.tolist()``, a blocking copy...)
    warns with its place, or raises. Under interleaved 1F1B on NCCL such a wait can deadlock the pipeline: the
    compute stream may be waiting for a receive whose peer sends only after this rank's next p2p call."""
    import os

    mode = os.environ.get(SYNC_DEBUG_ENV, "")
    if mode not in ("warn", "error") or not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def sum_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """``t`` of the last pipeline stage's TP rank 0 (losses live there; TP copies count once), on every
    rank."""
    from megatron.core import parallel_state

    last = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    t = t * (1.0 if last else 0.0)
    if multi_process():
        dist.all_reduce(t)
    return t


def count_placeholder(dev: torch.device) -> torch.Tensor:
    """The token count a loss function hands Megatron's schedule (a placeholder: see ``run_chunk``), made once
    per chunk on the device by a fill kernel. ``torch.tensor(1, device=cuda)`` would copy from pageable host
    memory, which synchronises the stream: once per microbatch the host would wait for the GPU to finish the
    forward, and a microbatch whose host work outlasts its GPU work (a small one) would cost its host time."""
    return torch.ones((), dtype=torch.int, device=dev)


def run_chunk(model, chunk: Chunk, optimizers: dict, *, seed: int, device: torch.device | None) -> dict:
    """Train on ``chunk`` (this rank's packed microbatches). Returns ``{"compute_s", "steps"}`` with one
    ``{"key", "loss", "grad_norm", "lr", "tokens"}`` per (job, batch), in plan step order."""

    from megatron_patches import after_each_backward
    from lorafusion.layers import set_batch

    pad = sp_pad(model)
    chunks = chunks_of(model)
    tracker = make_tracker(chunk, optimizers, len(chunks))
    which = {id(m): c for c, m in enumerate(chunks)}
    dev = device or torch.device("cpu")
    denom = {k: max(1, chunk.loss_tokens(k)) for k in tracker.keys}
    sums = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in tracker.keys}
    one = count_placeholder(dev)

    def forward_step(data_iterator, model_):
        batch, batch_of = next(data_iterator)
        record(f"forward chunk={which[id(model_)]} tokens={batch.num_tokens} batches={batch_of}")
        if len(chunks) > 1:
            tracker.before_forward(batch_of, which[id(model_)])
        else:
            tracker.before_forward(batch.adapters)
        output, batch = forward_packed(model_, batch, pad, dev,
                                       [dropout_seed(seed, n, batch_of[n]) for n in batch.adapters])

        def loss_func(per_token):
            parts, counted = segments(per_token, batch)
            total = counted.sum() * 0.0
            for name, losses, _ in parts:
                k = (name, batch_of[name])
                s = losses.sum()
                total = total + s / denom[k]
                sums[k] += s.detach().double()
            # The loss is already normalised per job by its global batch's token count. The config sets
            # calculate_per_token_loss=True (models/spec.py), under which Megatron divides the loss by
            # neither this count nor the number of microbatches; the count would only reach a
            # finalize_model_grads_func, which we do not set. So 1 is a placeholder, not a token count.
            return total, one, {}

        return output, loss_func

    t0 = time.perf_counter()
    hook = after_each_backward(tracker.after_backward) if len(chunks) > 1 else contextlib.nullcontext()
    with hook:
        run_schedule(chunks, forward_step, chunk.packed, lambda mb: mb[0].num_tokens, pad, forward_only=False)
    results = tracker.finish()
    compute_s = time.perf_counter() - t0
    set_batch(model, None, ())
    return {"compute_s": compute_s, "steps": _steps(chunk, tracker.keys, results, sums, denom)}


def _steps(chunk: Chunk, keys: list[Key], results: dict, sums: dict, denom: dict) -> list[dict]:
    """One row per (job, batch): its loss and grad norm, with one host synchronisation for the chunk."""
    stat = sum_from_last_stage(torch.stack([sums[k] for k in keys])).tolist()
    norms = torch.stack([results[k][0].float() for k in keys]).tolist()
    return [{"key": k, "loss": stat[i] / denom[k], "grad_norm": norms[i], "lr": results[k][1],
             "tokens": chunk.tokens(k)} for i, k in enumerate(keys)]
