"""Evaluation during training: each job's eval loss, best-eval checkpoint and early stopping.

A job with an eval set (``eval_dataset`` or ``eval_split``) is evaluated at the first chunk boundary at or
after every ``eval_every`` steps (the step recorded is the job's step at that boundary) and at its last
step. Jobs due at the same boundary are evaluated together in one forward-only pass: their eval samples
are packed into microbatches of the run's token capacity (first fit, longest first; each job's samples of a
microbatch adjacent, so one routing segment each), spread over the data-parallel ranks, and run through
Megatron's schedule with ``forward_only=True`` under ``torch.no_grad`` and ``model.eval()`` (no dropout).
The loss of a job is the token mean over its whole eval set with the training's masking (prompt tokens carry
no loss): token-loss sums and counts are summed over the ranks (last pipeline stage, TP rank 0).

After each evaluation: a new best (strictly lower) is checkpointed and marked ``best`` (pruning keeps it;
``lorafusion export RUN_DIR --job J --best`` exports it); ``early_stopping_patience: K`` ends the job after
K evaluations in a row without a new best, with status ``early_stopped``: no more batches and no more
updates (batches planned before still run, changing nothing), its adapter in ``adapters/<job>`` is its
state at the stop, its best-eval adapter the ``best`` checkpoint.
"""

from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import parallel_state

from lorafusion.data.packing import PackedBatch, noop_microbatch, pack_microbatch
from lorafusion.layers import set_batch
from lorafusion.runtime.jobs import JobStatus
from lorafusion.runtime.pipeline import (
    chunks_of,
    count_placeholder,
    forward_packed,
    run_schedule,
    segments,
    sp_pad,
    sum_from_last_stage,
)
from lorafusion.runtime.telemetry.status import eval_fields
from lorafusion.scheduler.pipeorder import interleave_padding


def pack_eval(sets: dict[str, list[tuple[list[int], int]]], capacity: int) -> list[PackedBatch]:
    """Every sample of ``sets`` (job -> [(token ids, prompt length)]) in microbatches of at most ``capacity``
    tokens (a longer sample gets a microbatch of its own). Deterministic: every rank packs the same."""
    order = list(sets)
    items = sorted(((len(toks), order.index(job), i) for job, samples in sets.items()
                    for i, (toks, _) in enumerate(samples)), key=lambda t: (-t[0], t[1], t[2]))
    bins: list[list[tuple[int, int]]] = []
    room: list[int] = []
    for n, j, i in items:
        b = next((k for k, r in enumerate(room) if r >= n), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append((j, i))
        room[b] -= n
    packed = []
    for content in bins:
        content.sort()  # by job, then sample: one routing segment per job
        samples = [(order[j], sets[order[j]][i][0]) for j, i in content]
        packed.append(pack_microbatch(samples, prompt_lengths=[sets[order[j]][i][1] for j, i in content],
                                      row_ids=[i for _, i in content]))
    return packed


def _per_rank(total: int, dp: int, virtual_stages: int) -> int:
    """Microbatches every DP rank runs: the same number on each, and under interleaved 1F1B a multiple of pp
    (Megatron's microbatch groups)."""
    n = -(-total // dp)
    return n + interleave_padding(n, parallel_state.get_pipeline_model_parallel_world_size(), virtual_stages)


def eval_losses(model, sets: dict[str, list[tuple[list[int], int]]], capacity: int, *, device=None,
                eos_id: int = 0) -> dict[str, tuple[float, int]]:
    """{job: (token-mean loss over its eval samples, loss tokens)} of the model as it is (collective over
    all ranks; every rank returns the same). The stage timers the model was built with
    (``config.timers``) are paused meanwhile: they measure training chunks only."""
    names = list(sets)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    everything = pack_eval(sets, capacity)
    mine = everything[dp_rank::dp]
    chunks = chunks_of(model)
    mine += [noop_microbatch(eos_id)] * (_per_rank(len(everything), dp, len(chunks)) - len(mine))
    pad = sp_pad(model)
    dev = device or torch.device("cpu")
    sums = torch.zeros(2 * len(names), dtype=torch.float64, device=dev)  # [loss sums..., token counts...]
    one = count_placeholder(dev)

    def forward_step(data_iterator, model_):
        output, batch = forward_packed(model_, next(data_iterator), pad, dev)

        def loss_func(per_token):
            parts, counted = segments(per_token, batch)
            for name, losses, mask in parts:
                j = names.index(name)
                sums[j] += losses.sum().double()
                sums[len(names) + j] += mask.sum().double()
            return counted.sum() * 0.0, one, {}

        return output, loss_func

    was_training, timers = model.training, model.config.timers
    model.eval()
    try:
        with torch.no_grad(), (contextlib.nullcontext() if timers is None else timers.paused()):
            run_schedule(chunks, forward_step, mine, lambda b: b.num_tokens, pad, forward_only=True)
    finally:
        set_batch(model, None, ())
        model.train(was_training)
    stat = sum_from_last_stage(sums).tolist()
    return {n: (stat[j] / max(1.0, stat[len(names) + j]), int(stat[len(names) + j]))
            for j, n in enumerate(names)}


class Evaluator:
    """The run's evaluation (see the module doc). ``after_chunk(chunk, metrics, progress)`` at every chunk
    boundary, on every rank, after the chunk's steps are counted; ``summary(js)`` the summary fields."""

    def __init__(self, model, jobs: dict, checkpoints, device=None, eos_id: int = 0):
        self.model, self.jobs, self.checkpoints, self.device, self.eos_id = (model, jobs, checkpoints, device,
                                                                             eos_id)

    def due(self, chunk) -> list[str]:
        """Jobs of ``chunk`` to evaluate now: a multiple of eval_every passed in the chunk, or the job's
        end."""
        out = []
        for name, batches in chunk.batches.items():
            js = self.jobs[name]
            if (js.eval_samples is None or js.status not in (JobStatus.RUNNING, JobStatus.CANCELLING)
                    or not batches):
                continue
            every = js.cfg.eval_every
            first = js.steps - len(batches) + 1
            if js.steps >= js.stream.total_steps or (
                    every and any(s % every == 0 for s in range(first, js.steps + 1))):
                out.append(name)
        return out

    def losses(self, names: list[str], capacity: int) -> dict[str, tuple[float, int]]:
        return eval_losses(self.model, {n: self.jobs[n].eval_samples for n in names}, capacity,
                           device=self.device, eos_id=self.eos_id)

    def after_chunk(self, chunk, metrics=None, progress=None) -> None:
        names = self.due(chunk)
        if not names:
            return
        longest = max(len(t) for n in names for t, _ in self.jobs[n].eval_samples)
        results = self.losses(names, max(int(chunk.plan.token_capacity), longest))
        for name in names:
            js = self.jobs[name]
            loss, tokens = results[name]
            js.last_eval = loss
            better = math.isfinite(loss) and (js.best_eval is None or loss < js.best_eval)
            if better:
                js.best_eval, js.best_step, js.evals_since_best = loss, js.steps, 0
            else:
                js.evals_since_best += 1
            if metrics is not None:
                metrics.log_eval({"job": name, "step": js.steps, "eval_loss": loss, "eval_tokens": tokens,
                                  "best_eval_loss": js.best_eval, "best_step": js.best_step})
            if progress is not None:
                progress.eval(name, loss)
                best = "new best" if better else ("best -" if js.best_eval is None else
                                                  f"best {js.best_eval:.4f} at step {js.best_step}")
                progress.log(f"{name} step {js.steps}/{js.stream.total_steps}  eval loss {loss:.4f} "
                             f"({tokens:,} tokens)  {best}")
            if better:
                self.checkpoints.save_best(name)
            patience = js.cfg.early_stopping_patience
            if patience and js.evals_since_best >= patience and js.steps < js.stream.total_steps:
                if progress is not None:
                    progress.log(f"job {name}: early stopped at step {js.steps}: {js.evals_since_best} "
                                 f"evaluations without a better eval loss than {js.best_eval:.4f} (step "
                                 f"{js.best_step}); `lorafusion export --best` exports that one")
                self.checkpoints.halt(name, JobStatus.EARLY_STOPPED)

    @staticmethod
    def summary(js) -> dict:
        """A job's eval fields of summary.json (none without an eval set)."""
        return eval_fields(js)
