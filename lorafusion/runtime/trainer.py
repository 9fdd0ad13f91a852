"""Multi-adapter training: composes the feed (jobs, data, planned chunks), the pipeline (one chunk through
Megatron's schedule with in-pipeline optimizer steps), metrics, the output directory's lock (:mod:`.outdir`),
per-job checkpoints (:mod:`.resume`) and export.

The feed prepares chunk k+1 on a background thread while chunk k trains (see :mod:`.feed`); a job's
checkpoint after chunk k records its data stream as of the end of chunk k (``Chunk.stream_states``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from lorafusion import ops
from lorafusion.config.schema import RunConfig
from lorafusion.core.errors import ConfigError
from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.layout import RunDir
from lorafusion.runtime.feed import Feed, job_state, load_jobs, scheduler_config, stage_split
from lorafusion.rundir.lock import OutputDirLock, check_output_dir
from lorafusion.runtime.online import check_adapter_fits, run_limits



class Trainer:
    """``Trainer(cfg).run()`` checks the launch and output directory, loads the data, builds the model with
    one adapter and optimizer per job, trains every job to its end (taking ``lorafusion submit`` / ``cancel``
    requests at chunk boundaries, see :mod:`.live`), exports the adapters and writes ``summary.json``.
    ``resume=True`` continues each job from its latest checkpoint."""

    SERVE_POLL_S = 2.0  # serving (no job left): how often the run looks for submissions

    def __init__(self, cfg: RunConfig, *, resume: bool = False, background_planning: bool = True,
                 allow_different_result: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.allow_different_result = allow_different_result  # resume despite settings that change the numbers
        self.background_planning = background_planning
        self.out = Path(cfg.output_dir)
        self._lock = OutputDirLock(self.out, cfg.source)
        self.memory_plan = None  # (set at start: lorafusion.runtime.memory.size_run)

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

        from lorafusion.layers import get_lora_context
        from lorafusion.models.base import base_arch, build_base
        from lorafusion.runtime.evaluate import Evaluator
        from lorafusion.dist import init_distributed, share_from_rank0
        from lorafusion.checkpoint.policy import JobCheckpoints
        from lorafusion.runtime.telemetry.timers import StageTimers

        cfg = self.cfg
        cfg.check_world_size()
        if cfg.kernels == "fused" and not torch.cuda.is_available():
            raise ConfigError(f"{cfg.source}: kernels: fused needs a CUDA GPU (Triton kernels); this machine has "
                              f"none — use auto (fused on CUDA, reference elsewhere) or reference")
        check_output_dir(self.out, cfg.source, resume=self.resume)
        self.tokenizer, self.jobs = load_jobs(cfg)
        info = init_distributed(cfg.parallelism.tp, cfg.parallelism.pp, seed=cfg.seed,
                                virtual_stages=cfg.parallelism.virtual_stages)
        self.is_logger = info["rank"] == 0
        dp_rank = parallel_state.get_data_parallel_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.arch, ckpt = base_arch(cfg.model.path, cfg.model.preset)
        if self.tokenizer.vocab_size > self.arch.vocab_size:
            raise ConfigError(f"{cfg.source}: tokenizer: vocab_size {self.tokenizer.vocab_size} exceeds the "
                              f"model's vocab_size {self.arch.vocab_size}")
        # token_capacity / recompute_layers "auto" resolved for this GPU's memory (one clear error if nothing fits)
        from lorafusion.runtime.memory import recompute_kwargs, size_run

        self.memory_plan = size_run(cfg, self.arch, self.jobs, is_logger=self.is_logger)
        self._lock.acquire(self.is_logger, share=share_from_rank0)  # (after the checks that may refuse the run)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        self.model = build_base(self.arch, ckpt, dtype=cfg.model.dtype, device=self.device, seed=cfg.seed,
                                **recompute_kwargs(cfg, self.memory_plan, stage, self.arch),
                                sequence_parallel=cfg.parallelism.sequence_parallel,
                                stage_layers=stage_split(cfg, self.arch), base_precision=cfg.model.base_precision)
        get_lora_context(self.model).impl = None if cfg.kernels == "auto" else cfg.kernels
        self.timers = StageTimers()
        self.model.config.timers = self.timers  # Megatron's schedules time their stages through this hook
        for name, js in self.jobs.items():
            self._attach(js)
        self.checkpoints = JobCheckpoints(cfg, self.jobs, self.model, self.export, is_logger=self.is_logger,
                                          allow_different_result=self.allow_different_result)
        self.evaluator = Evaluator(self.model, self.jobs, self.checkpoints, self.device, self.tokenizer.eos_id)
        if self.resume:  # jobs added by `lorafusion submit` are not in the YAML: they come back from the run dir
            from lorafusion.runtime.online import submitted_jobs

            for job in submitted_jobs(self.out):
                if job.name not in self.jobs:
                    cfg.jobs.append(job)
                    self.jobs[job.name] = self._new_job(job)
            self.checkpoints.load()
        # after resuming: the feed continues every job's stream where its checkpoint left it
        self.feed = Feed(self.jobs, scheduler_config(cfg), dp_rank=dp_rank, eos_id=self.tokenizer.eos_id,
                         background=self.background_planning)

    def _train_chunk(self, chunk, number: int) -> dict:
        """Chunk ``number`` through the pipeline with every job's current optimizer; a CUDA out-of-memory is one
        clear error naming the stage, the predicted and the actual peak (:func:`.memory.oom_error`)."""
        from lorafusion.runtime.pipeline import run_chunk

        try:
            return run_chunk(self.model, chunk, {n: js.optimizer for n, js in self.jobs.items()}, seed=self.cfg.seed,
                             device=self.device)
        except torch.OutOfMemoryError:
            from megatron.core import parallel_state

            from lorafusion.runtime.memory import oom_error

            stage = parallel_state.get_pipeline_model_parallel_rank()
            raise oom_error(self.cfg, self.memory_plan, stage, number) from None

    def _new_job(self, job):
        """A job joining the run (resumed submission or ``lorafusion submit``): data, stream, adapter, optimizer."""
        js = job_state(job, self.tokenizer, self.cfg.seed)
        self._attach(js)
        return js

    def _attach(self, js) -> None:
        """Put the job's adapter on the model and give it its optimizer."""
        from lorafusion.layers import adapter_parameters, add_adapter
        from lorafusion.runtime.optim import AdapterOptimizer

        check_adapter_fits(self.cfg, js.cfg, self.arch)  # before allocating: lora.r = 10**12 is one clear error
        if js.cfg.init_from is not None:  # continued training of a PEFT adapter (a resume then loads its checkpoint)
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
        from lorafusion.runtime.telemetry.metrics import MetricsWriter, Progress, cut_metrics, max_memory_gib
        from lorafusion.checkpoint.handover import Handover
        from lorafusion.runtime.online import LiveJobs
        from lorafusion.runtime.telemetry.status import StatusWriter

        self._setup()
        cfg = self.cfg
        metrics = progress = status = None
        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.resume:  # rows after each job's checkpoint are trained again: drop them, never repeat them
                cut_metrics(RunDir(self.out).metrics, {n: js.steps for n, js in self.jobs.items()})
            else:  # a fresh run (the directory held at most a failed run's rows, see check_output_dir)
                RunDir(self.out).metrics.unlink(missing_ok=True)
            metrics = MetricsWriter(self.out, cfg.logging.tensorboard, cfg.logging.wandb, cfg.model_dump(mode="json"))
            progress = Progress.for_run(cfg.logging, {n: js.stream.total_steps for n, js in self.jobs.items()},
                                        max_memory_gib)
            from lorafusion.export.hf import base_reference

            base_reference(cfg, self.out, self.arch, self.device)  # base_model.json: for export, and submit's checks
            status = StatusWriter(self.out, self.jobs, limits=run_limits(cfg))  # status.json (lorafusion status)
        self.handover = Handover()  # writes what ended jobs leave while the others train
        t_start = time.perf_counter()
        windows = plan_s = noops = total_tokens = 0
        bubbles = []
        stopped = None
        last_timed_save = time.monotonic()
        every_s = cfg.checkpoint.every_minutes * 60.0
        try:
            live = LiveJobs(cfg, self.out, self.model, self.feed, self.jobs, is_logger=self.is_logger,
                            add_job=self._new_job, finish=self._finish_job,
                            log=progress.log if progress is not None else (lambda _m: None))
            live.poll()  # requests that came while the run was stopped
            idle_since = None
            while True:
                chunk = self.feed.next()
                if chunk is None:  # every job has ended: wait for submissions if serving, else the run is over
                    # the idle timeout is read on each rank's clock: the ranks agree on it through the poll (a
                    # rank that ended alone would leave the others waiting in the next poll's collective)
                    idle = idle_since is not None and time.monotonic() - idle_since > cfg.serve_idle_minutes * 60
                    stop, idle = stops.poll(idle)
                    if stop:
                        stopped = stops.received or "signal"
                        break
                    if live.poll() or live.busy:
                        idle_since = None
                        continue
                    if not cfg.serve or idle:
                        break
                    idle_since = idle_since or time.monotonic()
                    if status is not None:
                        status.write("serving")
                    time.sleep(self.SERVE_POLL_S)
                    continue
                idle_since = None
                if status is not None:  # the counts as of the last boundary; who this chunk trains
                    status.write(in_chunk=set(chunk.batches))
                # (jobs may have joined at the last boundary: the optimizers and the log order are the current ones)
                res = self._train_chunk(chunk, windows + 1)
                order = list(self.jobs)
                windows += 1
                plan_s += chunk.plan_s
                noops += chunk.plan.num_noops
                totals = self.timers.reset()  # every chunk: resolves (and frees) its timing events
                if cfg.parallelism.pp > 1 and (b := self.timers.bubble(totals)) is not None:
                    bubbles.append(b)
                mem_gib = max_memory_gib()
                self.checkpoints.chunk_done(chunk)
                for st in sorted(res["steps"], key=lambda r: (r["key"][1], order.index(r["key"][0]))):
                    name = st["key"][0]
                    js = self.jobs[name]
                    if js.halted:  # diverged/early-stopped in an earlier chunk; this one was planned before that
                        continue
                    js.steps += 1
                    js.tokens += st["tokens"]
                    total_tokens += st["tokens"]
                    finite = math.isfinite(st["loss"]) and math.isfinite(st["grad_norm"])
                    # the device skipped the update iff the gradient norm was not finite (a non-finite loss
                    # back-propagates into the gradients); either one counts towards divergence
                    skipped = not math.isfinite(st["grad_norm"])
                    js.nonfinite = 0 if finite else js.nonfinite + 1
                    if finite:
                        js.last_loss = st["loss"]
                        if js.first_loss is None:
                            js.first_loss = st["loss"]
                    if self.is_logger:
                        metrics.log_step({"job": name, "step": js.steps, "loss": st["loss"], "tokens": st["tokens"],
                                          "lr": st["lr"], "grad_norm": st["grad_norm"], "skipped": skipped,
                                          "tokens_per_s": round(total_tokens / max(1e-9, time.perf_counter() - t_start),
                                                                1),
                                          "max_memory_gib": round(mem_gib, 4),
                                          "elapsed_s": round(time.perf_counter() - t_start, 4)})
                        progress.update(name, js.steps, js.last_loss, st["tokens"], st["lr"], js.stream.total_steps)
                        if not finite:
                            progress.log(f"job {name}: step {js.steps} not finite (loss {st['loss']}, grad norm "
                                         f"{st['grad_norm']}){', update skipped' if skipped else ''}: "
                                         f"{js.nonfinite} in a row, paused at {js.cfg.max_nonfinite_steps}")
                    if js.nonfinite >= js.cfg.max_nonfinite_steps:
                        self._pause_diverged(name, progress)
                self.evaluator.after_chunk(chunk, metrics, progress)  # eval_loss rows, best checkpoint, early stop
                self.checkpoints.save_due(chunk)
                live.poll()  # lorafusion submit / cancel (collective); jobs that ended are handed over
                self.handover.check()  # a background write that failed fails the run here
                # ranks agree (one tiny collective per chunk) on a stop signal and on a timed checkpoint
                stop, timed = stops.poll(time.monotonic() - last_timed_save >= every_s)
                if stop or timed:
                    self.checkpoints.save_all(only_default_policy=not stop)
                    last_timed_save = time.monotonic()
                if stop:
                    stopped = stops.received or "signal"
                    self.feed.close()
                    break
            elapsed = time.perf_counter() - t_start
            if stopped is None:
                self.checkpoints.save_all(only_default_policy=True)  # the end of the run: every job's final state
            for name, js in self.jobs.items():  # (jobs handed over at a boundary were exported then)
                if js.status != "cancelled" and not js.handed_over and (js.steps >= js.stream.total_steps or js.halted):
                    self.export(name, RunDir(self.out).adapter(name))
            self.handover.close()  # every hand-over written before the summary says done
        finally:
            try:
                self.handover.close()  # (after an error too: what was handed over is written)
            except Exception as e:  # noqa: BLE001 - the run failed already; that error goes on
                print(f"lorafusion: a background write failed as well: {type(e).__name__}: {e}", file=sys.stderr)
            if progress is not None:
                progress.close()
            if metrics is not None:
                metrics.close()
        summary = {
            "status": "stopped" if stopped else "done", "stopped_by": stopped,
            "tokens": sum(js.tokens for js in self.jobs.values()),  # the whole run, resumed parts included
            "session_tokens": total_tokens,
            "elapsed_s": round(elapsed, 3), "tokens_per_s": total_tokens / max(elapsed, 1e-9),
            "windows": windows, "plan_s": round(plan_s, 3), "plan_wait_s": round(self.feed.wait_s, 3),
            "noop_microbatches": noops, "bubble_ratio": (sum(bubbles) / len(bubbles)) if bubbles else None,
            "parallelism": cfg.parallelism.model_dump(), "memory_plan": self.memory_plan and self.memory_plan.to_dict(),
            "kernels": ops.resolve_impl(
                torch.empty(0, device=self.device or "cpu"), None if cfg.kernels == "auto" else cfg.kernels),
            "jobs": {n: {"status": js.final_status,
                         "steps": js.steps, "total_steps": js.stream.total_steps, "tokens": js.tokens,
                         "final_loss": js.last_loss, "first_loss": js.first_loss, **self.evaluator.summary(js)}
                     for n, js in self.jobs.items()},
        }
        if self.is_logger:
            write_text_atomic(RunDir(self.out).summary, json.dumps(summary, indent=2) + "\n")
            status.write(summary["status"], {n: j["status"] for n, j in summary["jobs"].items()})
        return summary

    # ------------------------------------------------------------------------------- export / checkpoint
    def snapshot(self, name: str) -> tuple | None:
        """Adapter ``name`` in host memory as a PEFT adapter of this run's base (collective; rank 0 gets it)."""
        from lorafusion.export.peft import peft_adapter_snapshot
        from lorafusion.export.hf import base_reference

        return peft_adapter_snapshot(self.model, name, self.arch,
                                     base_reference(self.cfg, self.out, self.arch, self.device))

    def export(self, name: str, out_dir: Path) -> None:
        from lorafusion.export.peft import write_peft_adapter

        if (snap := self.snapshot(name)) is not None:
            write_peft_adapter(out_dir, *snap)

    def _finish_job(self, name: str, release: bool) -> None:
        """Hand over a job that ended (done, cancelled, diverged, early-stopped; collective, quick): its final
        checkpoint (its stream as of its last chunk) and its adapter are taken to host memory and written in
        the background (``js.written`` once complete); with ``release`` its adapter and optimizer state leave
        the model."""
        from lorafusion.layers import remove_adapter
        from lorafusion.export.peft import write_peft_adapter
        from lorafusion.rundir.atomic import copier, fill_dir_atomically

        js = self.jobs[name]
        snap = self.snapshot(name)
        save = self.checkpoints.start_final(name, snap)
        out = RunDir(self.out).adapter(name)

        def write() -> None:
            saved = save() if save is not None else None  # (the checkpoint's directory on rank 0)
            if saved is not None:  # its adapter, serialised once already: copied
                fill_dir_atomically(out, copier(saved / "adapter"))
            elif snap is not None:
                write_peft_adapter(out, *snap)

        js.handed_over = True
        self.handover.submit(write, on_done=lambda: setattr(js, "written", True))
        if release:
            remove_adapter(self.model, name)
            js.optimizer = None

    def _pause_diverged(self, name: str, progress) -> None:
        """Stop a job whose last ``max_nonfinite_steps`` steps were all non-finite: no more batches (from the
        next planned chunk on) and no more updates; its weights are those of its last finite step (skipped
        steps change nothing), checkpointed now and exported at the end as its adapter."""
        js = self.jobs[name]
        js.status = "diverged"
        js.optimizer.paused = True
        if progress is not None:
            progress.log(f"job {name}: diverged ({js.nonfinite} non-finite steps in a row) — paused at step "
                         f"{js.steps}; its adapter is its last finite state; the other jobs continue")
        self.checkpoints.save_now(name)


