"""Multi-adapter training: composes the feed (jobs, data, planned chunks), the pipeline (one chunk through
Megatron's schedule with in-pipeline optimizer steps), metrics, checkpoints and export.

The feed prepares chunk k+1 on a background thread while chunk k trains (see :mod:`.feed`); a job's
checkpoint after chunk k records its data stream as of the end of chunk k (``Chunk.stream_states``).
"""

from __future__ import annotations

import json
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

    # ------------------------------------------------------------------------------------------- set-up
    def _check_output_dir(self) -> None:
        if self.resume or not self.out.exists():
            return
        taken = [n for n in ("metrics.jsonl", "checkpoints", "adapters", "summary.json") if (self.out / n).exists()]
        if taken:
            raise ConfigError(f"{self.cfg.source}: output_dir: {self.out} already holds a run ({', '.join(taken)}); "
                              f"choose another output_dir or resume it with --resume")

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
        self._check_output_dir()
        self.tokenizer, self.jobs = load_jobs(cfg)
        info = init_distributed(cfg.parallelism.tp, cfg.parallelism.pp, seed=cfg.seed)
        self.is_logger = info["rank"] == 0
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
        from lorafusion.runtime.metrics import MetricsWriter, Progress
        from lorafusion.runtime.pipeline import run_chunk

        self._setup()
        cfg = self.cfg
        metrics = progress = None
        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            metrics = MetricsWriter(self.out, tensorboard=cfg.logging.tensorboard)
            progress = Progress({n: js.stream.total_steps for n, js in self.jobs.items()},
                                enabled=cfg.logging.progress)
        optimizers = {n: js.optimizer for n, js in self.jobs.items()}
        order = list(self.jobs)
        t_start = time.perf_counter()
        windows = plan_s = noops = total_tokens = 0
        bubbles = []
        try:
            while (chunk := self.feed.next()) is not None:
                res = run_chunk(self.model, chunk, optimizers, seed=cfg.seed, device=self.device)
                windows += 1
                plan_s += chunk.plan_s
                noops += chunk.plan.num_noops
                totals = self.timers.reset()  # every chunk: resolves (and frees) its timing events
                if cfg.parallelism.pp > 1 and (b := self.timers.bubble(totals)) is not None:
                    bubbles.append(b)
                for st in sorted(res["steps"], key=lambda r: (r["key"][1], order.index(r["key"][0]))):
                    name = st["key"][0]
                    js = self.jobs[name]
                    js.steps += 1
                    js.tokens += st["tokens"]
                    total_tokens += st["tokens"]
                    js.last_loss = st["loss"]
                    if js.first_loss is None:
                        js.first_loss = st["loss"]
                    if self.is_logger:
                        metrics.log_step({"job": name, "step": js.steps, "loss": st["loss"], "tokens": st["tokens"],
                                          "lr": st["lr"], "grad_norm": st["grad_norm"],
                                          "elapsed_s": round(time.perf_counter() - t_start, 4)})
                        progress.update(name, js.steps, js.last_loss, st["tokens"])
                self._save_due_checkpoints(chunk)
            elapsed = time.perf_counter() - t_start
            for name in self.jobs:
                self.export(name, self.out / "adapters" / name)
        finally:
            if progress is not None:
                progress.close()
            if metrics is not None:
                metrics.close()
        summary = {
            "tokens": total_tokens, "elapsed_s": round(elapsed, 3), "tokens_per_s": total_tokens / max(elapsed, 1e-9),
            "windows": windows, "plan_s": round(plan_s, 3), "plan_wait_s": round(self.feed.wait_s, 3),
            "noop_microbatches": noops, "bubble_ratio": (sum(bubbles) / len(bubbles)) if bubbles else None,
            "parallelism": cfg.parallelism.model_dump(), "kernels": ops.resolve_impl(
                torch.empty(0, device=self.device or "cpu"), None if cfg.kernels == "auto" else cfg.kernels),
            "jobs": {n: {"steps": js.steps, "tokens": js.tokens, "final_loss": js.last_loss,
                         "first_loss": js.first_loss} for n, js in self.jobs.items()},
        }
        if self.is_logger:
            write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    # ------------------------------------------------------------------------------- export / checkpoint
    def export(self, name: str, out_dir: Path) -> None:
        from lorafusion.runtime.export import export_peft_adapter

        export_peft_adapter(self.model, name, out_dir, self.arch, base_model=self.cfg.model.path or self.cfg.model.preset)

    def _save_due_checkpoints(self, chunk: Chunk) -> None:
        """Checkpoint every job of ``chunk`` whose ``save_every`` divides a step the chunk took."""
        for name, batches in chunk.batches.items():
            js = self.jobs[name]
            every = js.cfg.save_every
            if every and any(s % every == 0 for s in range(js.steps - len(batches) + 1, js.steps + 1)):
                self.save_checkpoint(name, chunk.stream_states[name])

    def save_checkpoint(self, name: str, stream_state: dict) -> None:
        """``stream_state``: the job's data stream as of the chunk boundary being saved (the feed's live
        stream is already a chunk further)."""
        from lorafusion.layers import adapter_parameters
        from lorafusion.runtime.checkpoint import save_job_checkpoint

        js = self.jobs[name]
        state = {"job": name, "step": js.steps, "tokens": js.tokens, "stream": stream_state,
                 "seed": self.cfg.seed, "layout": self.cfg.parallelism.model_dump()}
        save_job_checkpoint(self.out / "checkpoints" / name, js.steps,
                            adapter_params=adapter_parameters(self.model, name),
                            optimizer_state=js.optimizer.state_dict(), state=state,
                            write_adapter=lambda d: self.export(name, d))

    def _load_checkpoints(self) -> None:
        from lorafusion.layers import adapter_parameters
        from lorafusion.runtime.checkpoint import latest_checkpoint, load_job_checkpoint

        for name, js in self.jobs.items():
            path = latest_checkpoint(self.out / "checkpoints" / name)
            if path is None:
                continue
            state, tensors = load_job_checkpoint(path)
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


def remove_partial_outputs(out: Path) -> None:
    """Remove temporary files a failed run left behind (never complete checkpoints or exports)."""
    if not out.exists():
        return
    for p in list(out.rglob(".*.tmp*")):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
