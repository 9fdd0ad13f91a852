"""Multi-adapter training: composes the feed (jobs, data, planned chunks), the pipeline (one chunk through
Megatron's schedule with in-pipeline optimizer steps), metrics, checkpoints and export.

The feed prepares chunk k+1 on a background thread while chunk k trains (see :mod:`.feed`); a job's
checkpoint after chunk k records its data stream as of the end of chunk k (``Chunk.stream_states``).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from lorafusion import ops
from lorafusion.config.schema import RunConfig
from lorafusion.core.errors import ConfigError
from lorafusion.runtime.checkpoint import write_text_atomic
from lorafusion.runtime.feed import Chunk, Feed, load_jobs, scheduler_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Trainer:
    """``Trainer(cfg).run()`` checks the launch and output directory, loads the data, builds the model with
    one adapter and optimizer per job, trains every job to its end, exports the adapters and writes
    ``summary.json``. ``resume=True`` continues each job from its latest checkpoint."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, background_planning: bool = True):
        self.cfg = cfg
        self.resume = resume
        self.background_planning = background_planning
        self.out = Path(cfg.output_dir)
        self.owns_output_dir = False  # this process holds output_dir's lock (so may clean it up after a failure)
        self._fingerprints: dict[str, dict] = {}
        self._saved_step: dict[str, int] = {}  # job -> step of its newest checkpoint
        self._stream_states: dict[str, dict] = {}  # job -> stream state at the newest chunk boundary

    # ------------------------------------------------------------------------------------------- set-up
    def _check_output_dir(self) -> None:
        if self.resume or not self.out.exists():
            return
        # what a failed run leaves before its first checkpoint (metrics rows, tensorboard, the lock) holds nothing
        # to keep: such a directory may be trained again from scratch
        taken = [n for n in ("checkpoints", "adapters", "summary.json")
                 if (self.out / n).exists() and not ((self.out / n).is_dir() and not any((self.out / n).iterdir()))]
        if taken:
            raise ConfigError(f"{self.cfg.source}: output_dir: {self.out} already holds a run ({', '.join(taken)}); "
                              f"choose another output_dir or resume it with --resume")

    def _lock_output_dir(self) -> None:
        """One run per output_dir: global rank 0 holds an exclusive ``flock`` on ``OUTPUT_DIR/.lock`` until the
        process ends (released by the OS even after a crash); every rank learns whether it got it."""
        import fcntl
        import os

        import torch.distributed as dist

        holder = ""
        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / ".lock"
            self._lock = path.open("a+")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.owns_output_dir = True
                self._lock.seek(0)
                self._lock.truncate()
                self._lock.write(f"{os.getpid()}\n")
                self._lock.flush()
            except BlockingIOError:
                self._lock.seek(0)
                holder = self._lock.read().strip() or "?"
                self._lock.close()
                self._lock = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [holder]
            dist.broadcast_object_list(box, src=0)
            holder = box[0]
        if holder:
            raise ConfigError(f"{self.cfg.source}: output_dir: {self.out} is in use by another lorafusion train "
                              f"(pid {holder}); wait for it to end or choose another output_dir")

    def release(self) -> None:
        """Release the output_dir lock (the end of the process releases it too)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.close()
            self._lock = None

    def _setup(self) -> None:
        from megatron.core import parallel_state

        from lorafusion.core.arch import preset
        from lorafusion.layers import adapter_parameters, add_adapter, get_lora_context
        from lorafusion.models.provider import build_model
        from lorafusion.runtime.dist import init_distributed
        from lorafusion.runtime.optim import AdapterOptimizer
        from lorafusion.runtime.timers import StageTimers

        cfg = self.cfg
        cfg.check_world_size()
        if cfg.kernels == "fused" and not torch.cuda.is_available():
            raise ConfigError(f"{cfg.source}: kernels: fused needs a CUDA GPU (Triton kernels); this machine has "
                              f"none — use auto (fused on CUDA, reference elsewhere) or reference")
        self._check_output_dir()
        self.tokenizer, self.jobs = load_jobs(cfg)
        info = init_distributed(cfg.parallelism.tp, cfg.parallelism.pp, seed=cfg.seed)
        self.is_logger = info["rank"] == 0
        self._lock_output_dir()
        dp_rank = parallel_state.get_data_parallel_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        ckpt = None
        if cfg.model.path:
            from lorafusion.models.hf_import import HFCheckpoint, build_model_from_hf

            ckpt = HFCheckpoint(cfg.model.path)
            self.arch = ckpt.arch
        else:
            self.arch = preset(cfg.model.preset)
        if self.tokenizer.vocab_size > self.arch.vocab_size:
            raise ConfigError(f"{cfg.source}: tokenizer: vocab_size {self.tokenizer.vocab_size} exceeds the "
                              f"model's vocab_size {self.arch.vocab_size}")
        kw = dict(params_dtype=DTYPES[cfg.model.dtype], recompute=cfg.model.recompute, device=self.device,
                  seed=cfg.seed, sequence_parallel=cfg.parallelism.sequence_parallel)
        self.model = build_model_from_hf(ckpt, **kw) if ckpt is not None else build_model(self.arch, **kw)
        get_lora_context(self.model).impl = None if cfg.kernels == "auto" else cfg.kernels
        self.timers = StageTimers()
        self.model.config.timers = self.timers  # Megatron's schedules time their stages through this hook
        for name, js in self.jobs.items():
            add_adapter(self.model, name, js.cfg.lora, seed=cfg.seed)
            params = list(adapter_parameters(self.model, name).values())
            js.optimizer = AdapterOptimizer.from_config(params, js.cfg.optimizer, js.stream.total_steps)
        if self.resume:
            self._load_checkpoints()
        # after resuming: the feed continues every job's stream where its checkpoint left it
        self.feed = Feed(self.jobs, scheduler_config(cfg), dp_rank=dp_rank, eos_id=self.tokenizer.eos_id,
                         background=self.background_planning)

    # -------------------------------------------------------------------------------------------- loop
    def run(self) -> dict:
        from lorafusion.runtime.control import StopSignals

        try:
            with StopSignals() as stops:
                return self._run(stops)
        finally:
            self.release()

    def _run(self, stops) -> dict:
        from lorafusion.runtime.metrics import MetricsWriter, Progress, cut_metrics, max_memory_gib
        from lorafusion.runtime.pipeline import run_chunk

        self._setup()
        cfg = self.cfg
        metrics = progress = None
        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.resume:  # rows after each job's checkpoint are trained again: drop them, never repeat them
                cut_metrics(self.out / "metrics.jsonl", {n: js.steps for n, js in self.jobs.items()})
            else:  # a fresh run (the directory held at most a failed run's rows, see _check_output_dir)
                (self.out / "metrics.jsonl").unlink(missing_ok=True)
            metrics = MetricsWriter(self.out, tensorboard=cfg.logging.tensorboard)
            progress = Progress({n: js.stream.total_steps for n, js in self.jobs.items()},
                                enabled=cfg.logging.progress, log_every=cfg.logging.log_every)
        optimizers = {n: js.optimizer for n, js in self.jobs.items()}
        order = list(self.jobs)
        t_start = time.perf_counter()
        windows = plan_s = noops = total_tokens = 0
        bubbles = []
        stopped = None
        last_timed_save = time.monotonic()
        every_s = cfg.checkpoint.every_minutes * 60.0
        try:
            while (chunk := self.feed.next()) is not None:
                res = run_chunk(self.model, chunk, optimizers, seed=cfg.seed, device=self.device)
                windows += 1
                plan_s += chunk.plan_s
                noops += chunk.plan.num_noops
                totals = self.timers.reset()  # every chunk: resolves (and frees) its timing events
                if cfg.parallelism.pp > 1 and (b := self.timers.bubble(totals)) is not None:
                    bubbles.append(b)
                mem_gib = max_memory_gib()
                self._stream_states.update({n: s for n, s in chunk.stream_states.items()
                                            if self.jobs[n].status != "diverged"})
                for st in sorted(res["steps"], key=lambda r: (r["key"][1], order.index(r["key"][0]))):
                    name = st["key"][0]
                    js = self.jobs[name]
                    if js.status == "diverged":  # paused in an earlier chunk; this one was planned before that
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
                        progress.update(name, js.steps, js.last_loss, st["tokens"], st["lr"])
                        if not finite:
                            progress.log(f"job {name}: step {js.steps} not finite (loss {st['loss']}, grad norm "
                                         f"{st['grad_norm']}){', update skipped' if skipped else ''}: "
                                         f"{js.nonfinite} in a row, paused at {js.cfg.max_nonfinite_steps}")
                    if js.nonfinite >= js.cfg.max_nonfinite_steps:
                        self._pause_diverged(name, progress)
                self._save_due_checkpoints(chunk)
                # ranks agree (one tiny collective per chunk) on a stop signal and on a timed checkpoint
                stop, timed = stops.poll(time.monotonic() - last_timed_save >= every_s)
                if stop or timed:
                    self._save_all(only_default_policy=not stop)
                    last_timed_save = time.monotonic()
                if stop:
                    stopped = stops.received or "signal"
                    self.feed.close()
                    break
            elapsed = time.perf_counter() - t_start
            if stopped is None:
                self._save_all(only_default_policy=True)  # the end of the run: every job's final state
            for name, js in self.jobs.items():
                if js.steps >= js.stream.total_steps or js.status == "diverged":
                    self.export(name, self.out / "adapters" / name)
        finally:
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
            "parallelism": cfg.parallelism.model_dump(), "kernels": ops.resolve_impl(
                torch.empty(0, device=self.device or "cpu"), None if cfg.kernels == "auto" else cfg.kernels),
            "jobs": {n: {"status": self._job_status(js),
                         "steps": js.steps, "total_steps": js.stream.total_steps, "tokens": js.tokens,
                         "final_loss": js.last_loss, "first_loss": js.first_loss} for n, js in self.jobs.items()},
        }
        if self.is_logger:
            write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    @staticmethod
    def _job_status(js) -> str:
        if js.status == "diverged":
            return "diverged"
        return "done" if js.steps >= js.stream.total_steps else "stopped"

    # ------------------------------------------------------------------------------- export / checkpoint
    def export(self, name: str, out_dir: Path) -> None:
        from lorafusion.runtime.export import export_peft_adapter
        from lorafusion.runtime.export_models import base_reference

        export_peft_adapter(self.model, name, out_dir, self.arch, base_model=base_reference(self.cfg, self.out, self.arch, self.device))

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
        self._saved_step.pop(name, None)
        self.save_checkpoint(name, self._stream_states[name])

    def _save_due_checkpoints(self, chunk: Chunk) -> None:
        """Checkpoint every job of ``chunk`` whose ``save_every`` divides a step the chunk took."""
        for name, batches in chunk.batches.items():
            js = self.jobs[name]
            every = js.cfg.save_every
            if every and js.status != "diverged" and any(s % every == 0 for s in range(js.steps - len(batches) + 1, js.steps + 1)):
                self.save_checkpoint(name, chunk.stream_states[name])

    def _save_all(self, *, only_default_policy: bool) -> None:
        """Checkpoint every job not yet saved at its current step (``only_default_policy``: only jobs without
        ``save_every``, whose policy is time-based and at the end; a stop signal saves every job)."""
        for name, js in self.jobs.items():
            if only_default_policy and js.cfg.save_every:
                continue
            if self._saved_step.get(name) != js.steps and name in self._stream_states:
                self.save_checkpoint(name, self._stream_states[name])

    def save_checkpoint(self, name: str, stream_state: dict) -> None:
        """``stream_state``: the job's data stream as of the chunk boundary being saved (the feed's live
        stream is already a chunk further)."""
        from lorafusion.layers import adapter_parameters
        from lorafusion.runtime.checkpoint import save_job_checkpoint

        js = self.jobs[name]
        state = {"job": name, "step": js.steps, "tokens": js.tokens, "stream": stream_state,
                 "first_loss": js.first_loss, "last_loss": js.last_loss, "status": js.status,
                 "nonfinite": js.nonfinite,
                 "seed": self.cfg.seed, "layout": self.cfg.parallelism.model_dump(),
                 "settings": self._settings(name)}
        save_job_checkpoint(self.out / "checkpoints" / name, js.steps,
                            adapter_params=adapter_parameters(self.model, name),
                            optimizer_state=js.optimizer.state_dict(), state=state,
                            write_adapter=lambda d: self.export(name, d), keep_last=self.cfg.checkpoint.keep_last)
        self._saved_step[name] = js.steps

    def _settings(self, name: str) -> dict:
        """What a resume must find unchanged for job ``name`` (flat dotted keys as in the YAML): everything that
        changes its result except ``max_steps`` / ``num_epochs`` (raising them continues the job; its lr
        schedule then spans the new total) and ``save_every``."""
        if name not in self._fingerprints:
            cfg, job = self.cfg, self.jobs[name].cfg
            ds = job.dataset.model_dump(exclude={"path"})
            ds["sha256"] = file_sha256(Path(job.dataset.path))
            tree = {"lora": job.lora.model_dump(mode="json"), "optimizer": job.optimizer.model_dump(mode="json"),
                    "global_batch_size": job.global_batch_size, "dataset": ds}
            flat = _flatten(tree)
            # (paths by name only: a run directory that moved with its data still resumes)
            flat.update({"(run) seed": cfg.seed, "(run) model.dtype": cfg.model.dtype,
                         "(run) model": Path(cfg.model.path).name if cfg.model.path else cfg.model.preset,
                         "(run) tokenizer.type": cfg.tokenizer.type})
            self._fingerprints[name] = flat
        return self._fingerprints[name]

    def _check_settings(self, name: str, path: Path, saved: dict | None) -> None:
        if saved is None:  # a checkpoint written before settings were recorded
            return
        index = next(i for i, j in enumerate(self.cfg.jobs) if j.name == name)
        now = self._settings(name)
        for key in sorted(set(saved) | set(now)):
            if saved.get(key) != now.get(key):
                field = key.replace("(run) ", "") if key.startswith("(run) ") else \
                    f"jobs.{index}.{key.replace('dataset.sha256', 'dataset.path')}"
                what = "the data file's contents changed" if key == "dataset.sha256" else \
                    f"the checkpoint has {saved.get(key)!r}, the config {now.get(key)!r}"
                raise ConfigError(f"{self.cfg.source}: {field}: cannot resume job {name!r} from {path}: {what}; "
                                  f"resuming would change its result (raising max_steps/num_epochs is allowed; "
                                  f"otherwise use a new output_dir)")

    def _load_checkpoints(self) -> None:
        from lorafusion.layers import adapter_parameters
        import torch.distributed as dist

        from lorafusion.core.errors import MissingFileError
        from lorafusion.runtime.checkpoint import load_newest_usable

        for name, js in self.jobs.items():
            path, state, tensors, skipped = load_newest_usable(self.out / "checkpoints" / name)
            if dist.is_initialized() and dist.get_world_size() > 1:  # every rank must resume the same step
                steps = [None] * dist.get_world_size()
                dist.all_gather_object(steps, None if path is None else path.name)
                if len(set(steps)) > 1:
                    raise MissingFileError(f"{self.out / 'checkpoints' / name}: ranks found different usable "
                                           f"checkpoints ({sorted(set(map(str, steps)))}); a checkpoint is damaged")
            if path is None:
                continue
            if skipped and self.is_logger:
                for bad, why in skipped:
                    print(f"job {name}: checkpoint {bad} is not usable ({why}); falling back", flush=True)
                print(f"job {name}: resuming from {path}", flush=True)
            self._check_settings(name, path, state.get("settings"))
            params = adapter_parameters(self.model, name)
            with torch.no_grad():
                for k, p in params.items():
                    if k not in tensors["adapter"] or tensors["adapter"][k].shape != p.shape:
                        raise ConfigError(f"{path}: adapter tensor {k} is missing or has another shape; "
                                          f"the checkpoint does not match job {name!r}'s lora settings")
                    p.copy_(tensors["adapter"][k])
            js.optimizer.load_state_dict(tensors["optimizer"])
            js.stream.load_state_dict(state["stream"])
            js.steps, js.tokens = state["step"], state.get("tokens", 0)
            js.first_loss, js.last_loss = state.get("first_loss"), state.get("last_loss")
            js.status, js.nonfinite = state.get("status", "running"), state.get("nonfinite", 0)
            js.optimizer.paused = js.status == "diverged"
            self._saved_step[name] = js.steps
            self._stream_states[name] = state["stream"]


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (1 MiB reads)."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def remove_partial_outputs(out: Path) -> None:
    """Remove temporary files a failed run left behind (never complete checkpoints or exports)."""
    if not out.exists():
        return
    for p in list(out.rglob(".*.tmp*")):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
