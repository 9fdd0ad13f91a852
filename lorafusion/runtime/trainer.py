"""Multi-adapter training: composes the jobs (:mod:`.jobs`), the feed (data, planned chunks), the pipeline
(one chunk through Megatron's schedule with in-pipeline optimizer steps), telemetry, the output directory's
lock (:mod:`lorafusion.rundir.lock`), per-job checkpoints (:mod:`lorafusion.checkpoint.policy`) and export.
The loop is thin (next chunk → run → record → callbacks); the boundary's own work is its first callback. Every
``auto`` is decided once by :func:`lorafusion.resolve.resolve` (``self.plan``, frozen); the config is never
written; submitted jobs join the registry (``self.jobs``). The feed prepares chunk k+1 on a background thread
while chunk k trains (:mod:`.feed`); a job's checkpoint after chunk k records its data stream as of chunk k's
end (``Chunk.stream_states``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lorafusion.checkpoint.handover import Handover
from lorafusion.config.resume import RECORD_NAME
from lorafusion.config.schema import RunConfig
from lorafusion.core.errors import ConfigError
from lorafusion.core.impls import lora_impl
from lorafusion.resolve import RunPlan, World, resolve
from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.lock import OutputDirLock, check_output_dir
from lorafusion.runtime.admission import check_adapter_fits, run_limits
from lorafusion.runtime.callbacks import Boundary, TrainerCallback  # noqa: F401 - TrainerCallback: the hooks
from lorafusion.runtime.feed import Feed
from lorafusion.runtime.gpu_memory import check_fit, gpu_memory
from lorafusion.runtime.jobs import JobState, JobStatus, job_state, load_jobs


class Trainer:
    """``Trainer(cfg).run()`` checks the launch and output directory, loads the data, resolves the run's plan,
    builds the model with one adapter and optimizer per job, trains every job to its end (taking
    ``lorafusion submit`` / ``cancel`` requests at chunk boundaries, see :mod:`.admission`), exports the
    adapters and writes ``summary.json``. ``resume=True`` continues each job from its latest checkpoint."""

    SERVE_POLL_S = 2.0  # serving (no job left): how often the run looks for submissions

    def __init__(self, cfg: RunConfig, *, resume: bool = False, background_planning: bool = True,
                 allow_different_result: bool = False, callbacks: Sequence = (),
                 config_record: dict | None = None):
        self.cfg = cfg  # read only
        self.config_record = config_record  # written to RUN_DIR/run_config.json at start (config/resume.py)
        self._user_callbacks = list(callbacks)  # see TrainerCallback
        self.resume = resume
        self.allow_different_result = allow_different_result  # resume even if settings change the numbers
        self.background_planning = background_planning
        self.out = Path(cfg.output_dir)
        self._lock = OutputDirLock(self.out, cfg.source)
        self.handover = Handover()  # writes what ended jobs leave while the others train
        # set up by _setup (the launch, data, plan and model) and _open_session (this session's helpers)
        self.plan: RunPlan | None = None
        self.jobs: dict[str, JobState] = {}  # the job registry: the YAML's jobs, then submitted ones
        self.tokenizer = self.arch = self.device = self.model = self.timers = self.checkpoints = None
        self.evaluator = self.feed = self.adapters = self.telemetry = self.live = self._stops = None
        self.is_logger, self.callbacks = False, []
        self.stopped: str | None = None  # the stop signal that ended the run
        self._last_timed_save = self.elapsed = 0.0

    @property
    def owns_output_dir(self) -> bool:
        """This process holds output_dir's lock (so may clean it up after a failure)."""
        return self._lock.owned

    def release(self) -> None:
        """Release the output_dir lock (the end of the process releases it too)."""
        self._lock.release()

    # ------------------------------------------------------------------------------------------- set-up
    def _setup(self) -> None:
        from megatron.core import parallel_state

        from lorafusion.checkpoint.policy import JobCheckpoints
        from lorafusion.dist import init_distributed_for, set_virtual_stages, share_from_rank0
        from lorafusion.models.attention import select_for_run
        from lorafusion.models.base import base_arch, build_base
        from lorafusion.runtime.evaluate import Evaluator
        from lorafusion.runtime.handoff import AdapterHandoff
        from lorafusion.runtime.telemetry.timers import StageTimers

        cfg = self.cfg
        cfg.check_world_size()  # the launch first: one clear error before the data is read
        if lora_impl(cfg.kernels) == "triton" and not torch.cuda.is_available():
            raise ConfigError(f"{cfg.source}: kernels: fused needs a CUDA GPU (Triton kernels); this machine "
                              f"has none — use auto (fused on CUDA, reference elsewhere) or reference")
        check_output_dir(self.out, cfg.source, resume=self.resume)
        self.tokenizer, self.jobs = load_jobs(cfg)
        info = init_distributed_for(cfg.parallelism, seed=cfg.seed)
        self.is_logger = info["rank"] == 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.arch, ckpt = base_arch(cfg.model.path, cfg.model.preset)
        if self.tokenizer.vocab_size > self.arch.vocab_size:
            raise ConfigError(f"{cfg.source}: tokenizer: vocab_size {self.tokenizer.vocab_size} exceeds the "
                              f"model's vocab_size {self.arch.vocab_size}")
        attention = select_for_run(cfg, self.arch)  # model.attention: what runs here (checked on this GPU)
        self.plan = resolve(cfg, World(info["world"]), gpu_memory(), attention=attention)  # each auto once
        set_virtual_stages(self.plan.virtual_stages)  # (virtual_stages: auto is the plan's choice)
        check_fit(self.plan, is_logger=self.is_logger)  # printed; one clear error if nothing fits
        self._lock.acquire(self.is_logger, share=share_from_rank0)  # after the checks that may refuse the run
        stage = parallel_state.get_pipeline_model_parallel_rank()
        self.timers = StageTimers()  # Megatron's schedules time their stages through config.timers
        self.model = build_base(self.arch, ckpt, dtype=cfg.model.dtype, device=self.device, seed=cfg.seed,
                                timers=self.timers, lora_impl=lora_impl(self.plan.kernels),
                                **self.plan.model_kwargs(stage))
        for js in self.jobs.values():
            self._attach(js)
        self.adapters = AdapterHandoff(cfg, self.out, self.model, self.arch, self.device, self.jobs,
                                       self.handover)
        self.checkpoints = JobCheckpoints(cfg, self.plan, self.jobs, self.model, self.adapters.snapshot,
                                          is_logger=self.is_logger,
                                          allow_different_result=self.allow_different_result)
        self.evaluator = Evaluator(self.model, self.jobs, self.checkpoints, self.device,
                                   self.tokenizer.eos_id)
        if self.resume:  # jobs added by `lorafusion submit` are not in the YAML: they come from the run dir
            from lorafusion.runtime.admission import ended_without_data, resume_submitted

            resume_submitted(self.out, self.jobs, self._new_job, is_logger=self.is_logger,  # into self.jobs
                             ended=lambda j, e: ended_without_data(self.out, j, cfg.seed, self._attach, e))
            self.checkpoints.load()
        # after resuming: the feed continues every job's stream where its checkpoint left it
        self.feed = Feed(self.jobs, self.plan.scheduler, dp_rank=parallel_state.get_data_parallel_rank(),
                         eos_id=self.tokenizer.eos_id, background=self.background_planning)

    def _train_chunk(self, chunk, number: int) -> dict:
        """Chunk ``number`` through the pipeline; out of memory: one error (:func:`.gpu_memory.oom_error`)."""
        from lorafusion.runtime.pipeline import run_chunk

        try:
            return run_chunk(self.model, chunk, {n: js.optimizer for n, js in self.jobs.items()},
                             seed=self.cfg.seed, device=self.device)
        except torch.OutOfMemoryError:
            from megatron.core import parallel_state

            from lorafusion.runtime.gpu_memory import oom_error

            raise oom_error(self.plan, parallel_state.get_pipeline_model_parallel_rank(), number) from None

    def _new_job(self, job) -> JobState:
        """A job joining (a resumed submission or ``lorafusion submit``): data, stream, adapter, optimizer."""
        js = job_state(job, self.tokenizer, self.cfg.seed)
        self._attach(js)
        return js

    def _attach(self, js) -> None:
        """Put the job's adapter on the model and give it its optimizer."""
        from lorafusion.layers import adapter_parameters, add_adapter
        from lorafusion.runtime.optim import AdapterOptimizer

        check_adapter_fits(self.plan, js.cfg, self.arch)  # before allocating: lora.r=10**12: one clear error
        if js.cfg.init_from is not None:  # a PEFT adapter trained on (a resume then loads its checkpoint)
            from lorafusion.export.peft import import_peft_adapter

            import_peft_adapter(self.model, js.cfg.name, js.cfg.init_from, spec=js.cfg.lora,
                                where=f"{self.cfg.source}: jobs.{js.cfg.name}")
        else:
            add_adapter(self.model, js.cfg.name, js.cfg.lora, seed=self.cfg.seed)
        params = list(adapter_parameters(self.model, js.cfg.name).values())
        js.optimizer = AdapterOptimizer.from_config(params, js.cfg.optimizer, js.stream.total_steps)

    # -------------------------------------------------------------------------------------------- loop
    def run(self) -> dict:
        from lorafusion.runtime.signals import StopSignals

        try:
            with StopSignals() as stops:
                return self._run(stops)
        finally:
            self.release()

    def _run(self, stops) -> dict:
        """The loop: next chunk → run → record → callbacks (the boundary's work), until the run is over."""
        self._setup()  # a stop until here ends the process at once (nothing trained: nothing to checkpoint)
        stops.defer()
        self._open_session(stops)
        try:
            self.live.poll()  # requests that came while the run was stopped
            while (chunk := self._next_chunk()) is not None:
                self._notify("chunk_start", chunk)
                result = self._train_chunk(chunk, self.telemetry.chunks + 1)
                self._notify("chunk_ran", chunk, result)
                record = self._record(chunk, result)
                self._notify("chunk_end", chunk, record)
                if self._stop_or_save():
                    break
            self._end_session()
        finally:
            self._close_session()
        return self._summary()

    def _notify(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            if (fn := getattr(cb, hook, None)) is not None:
                fn(self, *args)

    # ------------------------------------------------------------------------------------------ session
    def _open_session(self, stops) -> None:
        """This session's outputs and helpers, and the boundary's work as the first callbacks."""
        from lorafusion.export.hf import base_reference
        from lorafusion.runtime.admission import LiveJobs
        from lorafusion.runtime.telemetry.session import Telemetry

        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            base_reference(self.cfg, self.out, self.arch, self.device)  # base_model.json (export, submit)
            if self.config_record is not None:  # the config this session started with: --resume continues it
                write_text_atomic(self.out / RECORD_NAME, json.dumps(self.config_record, indent=1) + "\n")
        self.telemetry = Telemetry(self.cfg, self.out, self.jobs, is_logger=self.is_logger,
                                   resume=self.resume, limits=run_limits(self.plan))
        self._stops, self.stopped, self._last_timed_save = stops, None, time.monotonic()
        self.live = LiveJobs(self.cfg, self.plan, self.out, self.model, self.feed, self.jobs,
                             is_logger=self.is_logger, add_job=self._new_job, log=self.telemetry.log,
                             finish=lambda name, rel: self.adapters.finish(name, rel, self.checkpoints))
        self.callbacks = [Boundary(), *self._user_callbacks]

    def _next_chunk(self):
        """The next chunk; None when the run is over: every job ended (serving: and none was submitted within
        serve_idle_minutes) or a stop came. The ranks agree on the idle timeout (rank clocks) via the poll."""
        idle_since = None
        while (chunk := self.feed.next()) is None:
            idle = idle_since is not None and time.monotonic() - idle_since > self.cfg.serve_idle_minutes * 60
            stop, idle = self._stops.poll(idle)
            if stop:
                self.stopped = self._stops.received or "signal"
                return None
            if self.live.poll() or self.live.busy:
                idle_since = None
                continue
            if not self.cfg.serve or idle:
                return None
            idle_since = idle_since or time.monotonic()
            self.telemetry.serving()
            time.sleep(self.SERVE_POLL_S)
        return chunk

    def _record(self, chunk, result: dict) -> dict:
        """Count the chunk's steps on their jobs (global-batch order), log them, pause diverged jobs."""
        from lorafusion.runtime.telemetry.metrics import max_memory_gib

        order = list(self.jobs)
        totals = self.timers.reset()  # every chunk: resolves (and frees) its timing events
        bubble = self.timers.bubble(totals) if self.plan.pp > 1 else None
        self.telemetry.chunk(chunk, bubble)
        mem_gib = max_memory_gib()
        self.checkpoints.chunk_done(chunk)
        for st in sorted(result["steps"], key=lambda r: (r["key"][1], order.index(r["key"][0]))):
            name = st["key"][0]
            js = self.jobs[name]
            if js.halted:  # diverged/early-stopped in an earlier chunk; this one was planned before that
                continue
            finite, skipped = js.record_step(st)
            self.telemetry.step(name, js, st, finite=finite, skipped=skipped, mem_gib=mem_gib)
            if js.diverging:
                self._pause_diverged(name)
        return {"result": result, "bubble": bubble, "max_memory_gib": mem_gib}

    def _stop_or_save(self) -> bool:
        """The ranks agree (one tiny collective per chunk) on a stop signal and on a timed checkpoint."""
        stop, timed = self._stops.poll(
            time.monotonic() - self._last_timed_save >= self.cfg.checkpoint.every_minutes * 60)
        if stop or timed:
            self.checkpoints.save_all(only_default_policy=not stop)
            self._last_timed_save = time.monotonic()
        if stop:
            self.stopped = self._stops.received or "signal"
            self.feed.close()
        return stop

    def _end_session(self) -> None:
        """Every job's final state checkpointed (unless stopped) and exported; every hand-over written."""
        self.elapsed = self.telemetry.elapsed
        if self.stopped is None:
            self.checkpoints.save_all(only_default_policy=True)  # the end of the run: every job's final state
        for name, js in self.jobs.items():  # (jobs handed over at a boundary were exported then)
            if js.status != JobStatus.CANCELLED and not js.handed_over and (js.finished or js.halted):
                self.adapters.export(name)
        self.handover.close()  # every hand-over written before the summary says done

    def _close_session(self) -> None:
        try:
            self.handover.close()  # (after an error too: what was handed over is written)
        except Exception as e:  # noqa: BLE001 - the run failed already; that error goes on
            print(f"lorafusion: a background write failed as well: {type(e).__name__}: {e}", file=sys.stderr)
        self.telemetry.close()

    def _summary(self) -> dict:
        from lorafusion.runtime.telemetry.summary import write_summary

        return write_summary(self)

    def _pause_diverged(self, name: str) -> None:
        """Stop a job whose last ``max_nonfinite_steps`` steps were all non-finite: no batches (from the next
        planned chunk) or updates; its last finite weights are checkpointed now and exported at the end."""
        js = self.jobs[name]
        self.telemetry.log(f"job {name}: diverged ({js.nonfinite} non-finite steps in a row) — paused at "
                           f"step {js.steps}; its adapter is its last finite state; the other jobs continue")
        self.checkpoints.halt(name, JobStatus.DIVERGED)
