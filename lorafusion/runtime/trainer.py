"""Multi-adapter training through Megatron-core's schedules (1F1B when PP > 1).

One *chunk* = the next ``scheduler.lookahead_batches`` global batches of every active job. The scheduler
packs the chunk's samples into balanced microbatches (grouping, MILP packing, merge), ``verify_plan``
proves the plan, and one call of Megatron's ``get_forward_backward_func`` runs this data-parallel rank's
microbatches. Each microbatch's loss is ``Σ_jobs (token-loss sum of the job's tokens in it) / (job's
loss tokens in its whole global batch)``, so the accumulated gradient of every adapter is exactly the
token-mean gradient of its global batch, as if trained alone. Each job's optimizer steps inside the
pipeline as soon as its global batch's backward is done on a stage (see :meth:`Trainer._run_chunk`):
DP reduction, clipping by its own full-adapter norm, its own AdamW; other jobs are untouched.

Dropout masks are keyed by (run seed, job, global batch index, layer) and per-row (sample id, position),
so they do not depend on packing or on the other jobs either.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lorafusion import ops
from lorafusion.config import ConfigError, RunConfig
from lorafusion.data import build_tokenizer, load_job_samples
from lorafusion.data.packing import PackedBatch, loss_token_count, noop_microbatch, pack_microbatch
from lorafusion.data.stream import JobStream
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.runtime.checkpoint import write_text_atomic

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class JobState:
    name: str
    cfg: object
    samples: list  # sample_id -> (token ids, prompt_len)
    stream: JobStream
    optimizer: object = None
    steps: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    done: bool = False
    first_loss: float | None = None


class Trainer:
    def __init__(self, cfg: RunConfig, *, config_path: str | None = None, resume: bool = False):
        self.cfg = cfg
        self.config_path = config_path or "run config"
        self.resume = resume
        self.out = Path(cfg.output_dir)
        self.jobs: dict[str, JobState] = {}
        self.metrics = None
        self.progress = None

    # ------------------------------------------------------------------------------------------- set-up
    def _check_world(self) -> None:
        p = self.cfg.parallelism
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if p.tp * p.pp * p.dp != world:
            raise ConfigError(f"{self.config_path}: parallelism: tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = "
                              f"{p.tp * p.pp * p.dp}, but the launch has {world} process(es)")

    def _check_output_dir(self) -> None:
        if self.resume or not self.out.exists():
            return
        taken = [n for n in ("metrics.jsonl", "checkpoints", "adapters", "summary.json") if (self.out / n).exists()]
        if taken:
            raise ConfigError(f"{self.config_path}: output_dir: {self.out} already holds a run ({', '.join(taken)}); "
                              f"choose another output_dir or resume it with --resume")

    def load_data(self) -> None:
        """Tokenizer, every job's samples and sample stream. Bad data fails here, before any model is
        built or anything is written."""
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.tokenizer, cfg.model.path)
        # (config validation keeps dataset.max_seq_len <= scheduler.token_capacity, and the loader keeps
        # every sample within max_seq_len, so every sample fits a microbatch)
        for job in cfg.jobs:
            data = load_job_samples(job, self.tokenizer)
            stream = JobStream(job.name, len(data.samples), job.global_batch_size, cfg.seed,
                               max_steps=job.max_steps, num_epochs=job.num_epochs)
            self.jobs[job.name] = JobState(job.name, job, data.samples, stream)

    def setup(self) -> None:
        from megatron.core import parallel_state

        from lorafusion.layers import adapter_parameters, add_adapter, get_lora_context
        from lorafusion.models.provider import build_model
        from lorafusion.models.spec import preset
        from lorafusion.runtime.dist import init_distributed
        from lorafusion.runtime.optim import AdapterOptimizer

        cfg = self.cfg
        self._check_world()
        self._check_output_dir()
        self.load_data()
        info = init_distributed(cfg.parallelism.tp, cfg.parallelism.pp, seed=cfg.seed)
        self.rank, self.dp_rank = info["rank"], parallel_state.get_data_parallel_rank()
        self.is_logger = self.rank == 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        dtype = DTYPES[cfg.model.dtype]
        ckpt = None
        if cfg.model.path:
            from lorafusion.models.hf_import import HFCheckpoint, build_model_from_hf

            ckpt = HFCheckpoint(cfg.model.path)
            self.arch = ckpt.arch
        else:
            self.arch = preset(cfg.model.preset)
        if self.tokenizer.vocab_size > self.arch.vocab_size:
            raise ConfigError(f"{self.config_path}: tokenizer: vocab_size {self.tokenizer.vocab_size} exceeds the "
                              f"model's vocab_size {self.arch.vocab_size}")
        kw = dict(params_dtype=dtype, recompute=cfg.model.recompute, device=self.device, seed=cfg.seed)
        self.model = build_model_from_hf(ckpt, **kw) if ckpt is not None else build_model(self.arch, **kw)
        get_lora_context(self.model).impl = None if cfg.kernels == "auto" else cfg.kernels
        for name, js in self.jobs.items():
            add_adapter(self.model, name, js.cfg.lora.to_spec(), seed=cfg.seed)
            params = list(adapter_parameters(self.model, name).values())
            js.optimizer = AdapterOptimizer.from_config(params, js.cfg.optimizer, js.stream.total_steps)
        if self.resume:
            self._load_checkpoints()

    # -------------------------------------------------------------------------------------------- loop
    def _dropout_seed(self, job: str, batch: int) -> int:
        return mix_seed(self.cfg.seed, name_key(job), batch)

    def _pack(self, mb) -> tuple[PackedBatch, dict[str, int]]:
        if mb.is_noop or not mb.entries:
            return noop_microbatch(self.tokenizer.eos_id), {}
        samples, prompts, rows, batch_of = [], [], [], {}
        for e in mb.entries:
            ids, plen = self.jobs[e.job].samples[e.sample_id]
            samples.append((e.job, ids[: e.num_tokens]))
            prompts.append(plen)
            rows.append(int(e.sample_id))
            batch_of[e.job] = e.batch
        return pack_microbatch(samples, prompt_lengths=prompts, row_ids=rows), batch_of

    def _plan(self, chunk: dict[str, list[tuple[int, list[int]]]]):
        """Plan a chunk {job: [(global batch index, sample ids), ...]} and prove it with verify_plan."""
        from lorafusion.scheduler import JobSpec, SchedulerConfig, plan, verify_plan

        specs = []
        for name, batches in chunk.items():
            js = self.jobs[name]
            specs.append(JobSpec(name=name,
                                 global_batches=[[(sid, len(js.samples[sid][0])) for sid in ids] for _, ids in batches],
                                 global_batch_size=js.cfg.global_batch_size, priority=js.cfg.priority,
                                 rank=js.cfg.lora.r, truncate=js.cfg.dataset.truncate,
                                 first_batch_index=batches[0][0]))
        p = self.cfg.parallelism
        sc = SchedulerConfig(pipeline_depth=p.pp, dp_size=p.dp, token_capacity=self.cfg.scheduler.token_capacity,
                             milp_time_limit_s=self.cfg.scheduler.milp_time_limit_s,
                             grouping=self.cfg.scheduler.grouping)
        t0 = time.perf_counter()
        # The MILP runs under a wall-clock limit, so two ranks planning alone could disagree; every rank
        # must run the same plan, so global rank 0 plans and broadcasts it.
        multi = dist.is_initialized() and dist.get_world_size() > 1
        box = [plan(specs, sc) if not multi or dist.get_rank() == 0 else None]
        if multi:
            dist.broadcast_object_list(box, src=0)
        the_plan = box[0]
        verify_plan(the_plan, specs, p.pp, p.dp)
        return the_plan, time.perf_counter() - t0

    def next_chunk(self, steps: dict[str, int] | None = None) -> dict[str, list[tuple[int, list[int]]]]:
        """The next ``scheduler.lookahead_batches`` global batches of every active job."""
        steps = steps if steps is not None else {n: js.steps for n, js in self.jobs.items()}
        chunk: dict[str, list[tuple[int, list[int]]]] = {}
        for name, js in self.jobs.items():
            for _ in range(self.cfg.scheduler.lookahead_batches):
                if js.done:
                    break
                ids = js.stream.next_global_batch()
                if ids is None:
                    js.done = True
                    break
                chunk.setdefault(name, []).append((steps[name], ids))
                steps[name] += 1
        return chunk

    def plan_only(self, out_dir: Path, max_windows: int = 20) -> dict:
        """``lorafusion plan``: schedule the first chunks of the run, write tables and charts, no model."""
        from lorafusion.scheduler import render_gantt, render_packing, simulate_plan
        from lorafusion.scheduler.simulate import bubble_ratio

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows, stats = [], []
        steps = {n: 0 for n in self.jobs}
        for w in range(max_windows):
            chunk = self.next_chunk(steps)
            if not chunk:
                break
            the_plan, plan_s = self._plan(chunk)
            ranks = {n: self.jobs[n].cfg.lora.r for n in chunk}
            timelines = simulate_plan(the_plan, ranks=ranks)
            cap = the_plan.token_capacity
            toks = [mb.num_tokens for mb in the_plan.microbatches if not mb.is_noop]
            stats.append({"window": w, "jobs": sorted(chunk), "microbatches": len(the_plan.microbatches),
                          "noops": the_plan.num_noops, "plan_s": round(plan_s, 4),
                          "fill": sum(toks) / (cap * max(1, len(toks))),
                          "imbalance": max(toks) / (sum(toks) / len(toks)) if toks else None,
                          "simulated_bubble": bubble_ratio(timelines)})
            for mb in the_plan.microbatches:
                rows.append({"window": w, "slot": mb.slot, "dp_rank": mb.dp_rank, "noop": mb.is_noop,
                             "tokens": mb.num_tokens, "segments": mb.segments()})
            if w == 0:
                render_gantt(the_plan, timelines[0], str(out_dir / "gantt.png"), title="chunk 0 (simulated 1F1B)")
                render_packing(the_plan, str(out_dir / "packing.png"), title="chunk 0 packing")
        (out_dir / "plan.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out_dir / "windows.json").write_text(json.dumps(stats, indent=2) + "\n")
        return {"windows": stats, "dir": str(out_dir)}

    def _run_chunk(self, chunk: dict[str, list[tuple[int, list[int]]]]) -> dict:
        """Run one planned chunk through a single 1F1B schedule, stepping each job's optimizer inside it.

        On stage s, 1F1B runs the backward of slot t before the forward of slot t + S - s. So when the
        forward of slot u is about to run, every (job, batch) whose last slot L has L + S - s <= u has
        finished backward on this stage: its step begins (DP reduction, async norm reduction); it ends
        (clip + AdamW) right before this stage's first forward that uses the job again, which the
        scheduler's dependency rule (first_slot(g+1) >= L + S) places after the beginning.
        """
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from lorafusion.layers import set_batch

        the_plan, plan_s = self._plan(chunk)
        my_mbs = the_plan.for_rank(self.dp_rank)
        packed = [self._pack(mb) for mb in my_mbs]
        S = self.cfg.parallelism.pp
        stage = parallel_state.get_pipeline_model_parallel_rank()
        keys = sorted(the_plan.last_microbatch, key=lambda k: (the_plan.step_slot(*k), k))
        begin_at = {k: the_plan.step_slot(*k) + S - stage for k in keys}
        begun: list[tuple[str, int]] = []
        step_out: dict[tuple[str, int], tuple[float, float]] = {}
        samples_of = {(n, b): ids for n, batches in chunk.items() for b, ids in batches}
        denom = {k: sum(loss_token_count(len(self.jobs[k[0]].samples[s][0]), self.jobs[k[0]].samples[s][1])
                        for s in ids) for k, ids in samples_of.items()}
        dev = self.device or torch.device("cpu")
        sums = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in samples_of}
        pending = {"slot": 0}

        def begin_ready(upto: int) -> None:
            for k in keys:
                if k not in begun and begin_at[k] <= upto:
                    self.jobs[k[0]].optimizer.begin_step()
                    begun.append(k)

        def end_before(jobs_next: set[str] | None) -> None:
            for k in list(begun):
                if k not in step_out and (jobs_next is None or k[0] in jobs_next):
                    step_out[k] = self.jobs[k[0]].optimizer.end_step()

        def forward_step(data_iterator, model_):
            slot = pending["slot"]
            pending["slot"] += 1
            batch, batch_of = next(data_iterator)
            begin_ready(slot)
            end_before(set(batch.adapters))
            batch = batch.to(dev)
            set_batch(model_, batch.routing, batch.adapters,
                      [self._dropout_seed(n, batch_of[n]) for n in batch.adapters])
            output = model_(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                            packed_seq_params=batch.packed_seq_params())

            def loss_func(per_token):
                total = per_token.sum() * 0.0
                for name in batch.adapters:
                    k = (name, batch_of[name])
                    m = batch.adapter_token_mask(name).to(per_token.dtype) * batch.loss_mask.to(per_token.dtype)
                    s = (per_token.float() * m).sum()
                    total = total + s / max(1, denom[k])
                    sums[k] += s.detach().double()
                return total, torch.tensor(1, dtype=torch.int, device=dev), {}

            return output, loss_func

        self.model.config.timers = self.timers
        t0 = time.perf_counter()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(packed), model=[self.model],
                                    num_microbatches=len(packed), seq_length=max(b.num_tokens for b, _ in packed),
                                    micro_batch_size=1, forward_only=False)
        begin_ready(10**9)  # the pipeline has drained: every backward is done
        end_before(None)
        compute_s = time.perf_counter() - t0
        set_batch(self.model, None, ())
        # losses live on the last stage; TP rank 0 contributes so TP copies count once
        last = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
        stat = torch.stack([sums[k] for k in keys]) * (1.0 if last else 0.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stat)
        stat = stat.tolist()  # one host synchronisation per chunk: losses and grad norms together
        norms = torch.stack([step_out[k][0].float() for k in keys]).tolist()
        steps = []
        for i, k in enumerate(keys):
            lr = step_out[k][1]
            steps.append({"key": k, "loss": stat[i] / max(1, denom[k]), "grad_norm": norms[i], "lr": lr,
                          "tokens": sum(len(self.jobs[k[0]].samples[s][0]) for s in samples_of[k])})
        steps.sort(key=lambda r: (r["key"][1], list(self.jobs).index(r["key"][0])))
        return {"plan": the_plan, "plan_s": plan_s, "compute_s": compute_s, "steps": steps}

    def run(self) -> dict:
        from lorafusion.runtime.metrics import MetricsWriter, Progress
        from lorafusion.runtime.timers import StageTimers

        if not hasattr(self, "model"):
            self.setup()
        cfg = self.cfg
        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsWriter(self.out, tensorboard=cfg.logging.tensorboard)
            self.progress = Progress({n: js.stream.total_steps for n, js in self.jobs.items()},
                                     enabled=cfg.logging.progress)
        self.timers = StageTimers()
        t_start = time.perf_counter()
        windows = plan_s = noops = total_tokens = 0
        bubbles = []
        try:
            while True:
                chunk = self.next_chunk()
                if not chunk:
                    break
                res = self._run_chunk(chunk)
                windows += 1
                plan_s += res["plan_s"]
                noops += res["plan"].num_noops
                totals = self.timers.reset()
                if cfg.parallelism.pp > 1 and (b := self.timers.bubble(totals)) is not None:
                    bubbles.append(b)
                for st in res["steps"]:
                    name = st["key"][0]
                    js = self.jobs[name]
                    js.steps += 1
                    js.tokens += st["tokens"]
                    total_tokens += st["tokens"]
                    js.last_loss = st["loss"]
                    rec = {"job": name, "step": js.steps, "loss": st["loss"], "tokens": st["tokens"], "lr": st["lr"],
                           "grad_norm": st["grad_norm"], "elapsed_s": round(time.perf_counter() - t_start, 4)}
                    if js.first_loss is None:
                        js.first_loss = st["loss"]
                    if self.is_logger:
                        self.metrics.log_step(rec)
                        self.progress.update(name, js.steps, js.last_loss, st["tokens"])
                for name in chunk:
                    js = self.jobs[name]
                    every = js.cfg.save_every
                    if every and any(s % every == 0 for s in range(js.steps - len(chunk[name]) + 1, js.steps + 1)):
                        self.save_checkpoint(name)
            elapsed = time.perf_counter() - t_start
            for name in self.jobs:
                self.export(name, self.out / "adapters" / name)
        finally:
            if self.progress is not None:
                self.progress.close()
            if self.metrics is not None:
                self.metrics.close()
        summary = {
            "tokens": total_tokens, "elapsed_s": round(elapsed, 3), "tokens_per_s": total_tokens / max(elapsed, 1e-9),
            "windows": windows, "plan_s": round(plan_s, 3), "noop_microbatches": noops,
            "bubble_ratio": (sum(bubbles) / len(bubbles)) if bubbles else None,
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

    def save_checkpoint(self, name: str) -> None:
        from lorafusion.layers import adapter_parameters
        from lorafusion.runtime.checkpoint import save_job_checkpoint

        js = self.jobs[name]
        state = {"job": name, "step": js.steps, "tokens": js.tokens, "stream": js.stream.state_dict(),
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
