"""The feed: jobs and their data in, the next planned chunk (packed for this rank) out.

One *chunk* = the next ``scheduler.lookahead_batches`` global batches of every active job. Preparing it:
draw the batches from the jobs' streams, look their samples up once, plan them (global rank 0 plans
and broadcasts: the MILP runs under a wall-clock limit, so two ranks planning alone could disagree),
prove the plan with ``verify_plan``, pack this data-parallel rank's microbatches and count each
global batch's loss tokens (the loss denominators).

With ``background=True`` the next chunk is prepared on a thread while the current one trains, so the
plan is ready when the pipeline needs it (the MILP solver is a subprocess and packing is short, so the
thread costs the training loop little). Chunks come out exactly as sequential preparation makes them:
one thread prepares them one after another in the same order, and the broadcast of chunk k+1 uses a
process group of its own, so it never interleaves with the training's collectives. Because the streams
then run one chunk ahead, every chunk carries its jobs' stream states *as of its own end*; checkpoints
must record those, never the live stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from lorafusion.dist import multi_process
from lorafusion.data.packing import PackedBatch, loss_token_count, noop_microbatch, pack_microbatch
from lorafusion.scheduler import (JobSpec, Microbatch, Plan, SchedulerConfig, dependency_distance, plan,
                                  policy, verify_plan)

from lorafusion.runtime.jobs import TRANSITIONS, JobState, JobStatus

Key = tuple[str, int]  # (job name, global batch index)


@dataclass(frozen=True)
class Sample:
    id: int
    tokens: list[int]
    prompt_len: int


@dataclass
class Chunk:
    """One planned chunk, ready to run on this rank."""

    batches: dict[str, list[tuple[int, list[Sample]]]]  # job -> [(global batch index, samples)]
    plan: Plan
    plan_s: float  # planning + broadcast + verify
    stream_states: dict[str, dict]  # each job's JobStream.state_dict() as of the end of this chunk
    packed: list[tuple[PackedBatch, dict[str, int]]] = field(default_factory=list)  # this rank's, with
    # the global batch index of each job in the microbatch

    def keys(self) -> list[Key]:
        return [(name, b) for name, bs in self.batches.items() for b, _ in bs]

    def loss_tokens(self, key: Key) -> int:
        """Positions of the global batch whose label counts: the denominator of its token-mean loss."""
        return sum(loss_token_count(len(s.tokens), s.prompt_len) for s in self._samples(key))

    def tokens(self, key: Key) -> int:
        return sum(len(s.tokens) for s in self._samples(key))

    def _samples(self, key: Key) -> list[Sample]:
        return next(samples for b, samples in self.batches[key[0]] if b == key[1])


class Feed:
    """Hands out the run's chunks in order (see the module docstring).

    ``sched``: the run's scheduler settings (``RunPlan.scheduler``). ``dp_rank=None`` plans without packing
    (``lorafusion plan``). ``eos_id`` fills no-op microbatches.
    """

    def __init__(self, jobs: dict[str, JobState], sched: SchedulerConfig, *, dp_rank: int | None = 0,
                 eos_id: int = 0, background: bool = False):
        self.jobs, self.sched, self.dp_rank, self.eos_id = jobs, sched, dp_rank, eos_id
        self.background = background
        self._multi = multi_process()
        # the broadcasts of plans get their own group, so a broadcast made on the planning thread never
        # interleaves with the training's collectives on the default group (collective call, every rank)
        self._group = dist.new_group(backend="gloo") if self._multi and background else None
        self._ahead: _Ahead | None = None
        self.wait_s = 0.0  # time the caller waited for a chunk that was not ready yet

    def next(self) -> Chunk | None:
        """The next chunk (None when every job is finished); in background mode, starts preparing the one
        after it before returning."""
        if not self.background:
            return self._prepare()
        t0 = time.perf_counter()
        chunk = (self._ahead or _Ahead(self._prepare)).result()
        self.wait_s += time.perf_counter() - t0
        self._ahead = _Ahead(self._prepare) if chunk is not None else None
        return chunk

    def update_jobs(self, change: Callable[[dict], None]) -> set[str]:
        """Apply ``change(jobs)`` (add a job, change a status) between two preparations: waits for the chunk
        being prepared in the background, which keeps what it drew. Returns the jobs that chunk holds (they
        still get its batches); a job added now is drawn from the chunk after it."""
        prepared: set[str] = set()
        if self._ahead is not None:
            try:
                chunk = self._ahead.result()
            except Exception:  # noqa: BLE001 - raised again by next()
                chunk = None
                change(self.jobs)
                return prepared
            if chunk is None:  # prepared before the change, when nothing was left: prepare again
                self._ahead = None
            else:
                prepared = set(chunk.batches)
        change(self.jobs)
        return prepared

    def close(self) -> None:
        """Wait for the chunk being prepared in the background (its plan broadcast is collective, so every
        rank finishes it) and drop it. Call before stopping early."""
        if self._ahead is not None:
            try:
                self._ahead.result()
            except Exception:  # noqa: BLE001 - a chunk that will never run; its error does not matter
                pass
            self._ahead = None

    # ----------------------------------------------------------------------------------------- steps
    def _draw(self) -> tuple[dict[str, list[tuple[int, list[Sample]]]], set[str]]:
        """The chunk's global batches (advances the streams) and which of its jobs only fill idle slots;
        the one place samples are looked up by id. The next ``lookahead_batches`` of each job that
        :func:`policy.chunk_jobs` names under ``scheduler.policy`` (every running job, or one), and as fill as
        many of its fill jobs' batches as the idle slots take."""
        batches: dict[str, list[tuple[int, list[Sample]]]] = {}

        def draw(name: str) -> list[Sample] | None:
            js = self.jobs[name]
            index = js.stream.steps_done
            ids = js.stream.next_global_batch()
            if ids is None:
                return None
            samples = [Sample(i, *js.samples[i]) for i in ids]
            batches.setdefault(name, []).append((index, samples))
            return samples

        with TRANSITIONS:  # a status changed on another thread is seen whole
            running = [n for n, js in self.jobs.items() if js.status == JobStatus.RUNNING
                       and not js.stream.finished]
        main, fill_order = policy.chunk_jobs(self.sched.policy, [
            policy.JobWork(n, self.jobs[n].cfg.priority, self._remaining_tokens(n)) for n in running])
        for name in main:
            for _ in range(self.sched.lookahead_batches):
                if draw(name) is None:
                    break
        if fill_order:
            room = policy.idle_slots(
                dependency_distance(self.sched.pipeline_depth, self.sched.virtual_stages), self.sched.dp_size,
                max((len(batches.get(n, ())) for n in main), default=0))
            policy.take_fill(fill_order,
                             lambda n: None if (got := draw(n)) is None else [len(s.tokens) for s in got],
                             self.sched.token_capacity, room)
        return batches, set(batches) - set(main)

    def _remaining_tokens(self, name: str) -> int:
        """Tokens a job has left to train: global batches left × its batch size × its mean sample length (an
        samples capped at 2**53 and tokens at 2**62: it converts to float, whatever the job's steps)."""
        js = self.jobs[name]
        left = max(0, js.stream.total_steps - js.stream.steps_done)
        return min(round(min(left * js.cfg.global_batch_size, 1 << 53) * js.mean_len), 1 << 62)

    def _specs(self, batches) -> list[JobSpec]:
        specs = []
        for name, bs in batches.items():
            job = self.jobs[name].cfg
            specs.append(JobSpec(name=name, global_batches=[[(s.id, len(s.tokens)) for s in samples]
                                                            for _, samples in bs],
                                 global_batch_size=job.global_batch_size, priority=job.priority,
                                 rank=job.lora.r, truncate=job.dataset.truncate, first_batch_index=bs[0][0]))
        return specs

    def _share(self, specs: list[JobSpec], fill: list[JobSpec]) -> Plan:
        """Global rank 0's plan, on every rank. A planning error on rank 0 is raised on every rank."""
        if not self._multi:
            return plan(specs, self.sched, fill=fill)
        from lorafusion.dist import share_from_rank0

        result = None
        if dist.get_rank() == 0:
            try:
                result = plan(specs, self.sched, fill=fill)
            except Exception as e:  # every rank must leave the broadcast, then raise the same error
                result = e
        result = share_from_rank0(result, group=self._group)
        if isinstance(result, Exception):
            raise result
        return result

    def _pack(self, mb: Microbatch,
              by_key: dict[tuple[str, int], Sample]) -> tuple[PackedBatch, dict[str, int]]:
        if mb.is_noop or not mb.entries:
            return noop_microbatch(self.eos_id), {}
        samples, prompts, rows, batch_of = [], [], [], {}
        for e in mb.entries:
            s = by_key[(e.job, e.sample_id)]
            samples.append((e.job, s.tokens[: e.num_tokens]))
            prompts.append(s.prompt_len)
            rows.append(int(e.sample_id))
            batch_of[e.job] = e.batch
        return pack_microbatch(samples, prompt_lengths=prompts, row_ids=rows), batch_of

    def _prepare(self) -> Chunk | None:
        batches, fill = self._draw()
        if not batches:
            return None
        states = {name: js.stream.state_dict() for name, js in self.jobs.items()}
        t0 = time.perf_counter()
        specs = self._specs(batches)
        the_plan = self._share([s for s in specs if s.name not in fill], [s for s in specs if s.name in fill])
        verify_plan(the_plan, specs, self.sched.pipeline_depth, self.sched.dp_size, self.sched.virtual_stages)
        chunk = Chunk(batches, the_plan, time.perf_counter() - t0, states)
        if self.dp_rank is not None:
            by_key = {(name, s.id): s for name, bs in batches.items() for _, samples in bs for s in samples}
            chunk.packed = [self._pack(mb, by_key) for mb in the_plan.for_rank(self.dp_rank)]
        return chunk


class _Ahead:
    """``fn()`` on a daemon thread (a daemon, so a run that fails elsewhere never waits on it at exit);
    ``result()`` joins it and returns its value or raises its exception."""

    def __init__(self, fn: Callable):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="lorafusion-feed", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
