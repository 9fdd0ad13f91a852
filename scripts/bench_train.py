"""End-to-end training throughput: lorafusion (N adapters at once) vs HF transformers + PEFT (one adapter at
a time, the way people run LoRA jobs today) on the same base shape, samples and LoRA settings, same device,
same run.

    python scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml --steps 6 --out results/
    python scripts/bench_train.py ... --ablate      # + fused kernels off, + scheduler off, in the same run
    python scripts/bench_train.py ... --profile     # + a torch.profiler summary of the first timed chunk
    torchrun --nproc_per_node 2 scripts/bench_train.py --config configs/qwen2.5-32b-4adapters.yaml \
        --steps 10 --warmup 2 --ablate --flush-per-batch --scale-json out/32b-pp2-2gpu.json parallelism.pp=2

Both sides train every job for ``--steps`` optimizer steps on identical global batches (the job streams of
the run config). Tokens/s counts real (unpadded) tokens and excludes the first ``--warmup`` steps of each
job. HF+PEFT pads each microbatch to its longest sample and packs samples into microbatches of at most
``token_capacity`` padded tokens. ``--ablate`` adds, on the same data: ``kernels=reference`` (our fast torch
LoRA path instead of the Triton kernels) and "scheduler off": one adapter job at a time through our own
runtime (each job alone, its own planned chunks: the way a Megatron-LM user runs LoRA jobs one after the
other). Prints a table and, as its last line, one JSON object.

Under torchrun (WORLD_SIZE > 1) every rank runs the same trainer runs and rank 0 alone prints and writes:
HF+PEFT is skipped (it is a one-GPU baseline), a failed run is not retried (the ranks would disagree),
peak memory and the steady-state bubble ratio are gathered per rank, and ``--scale-json PATH`` writes the
``docs/results/*-gpu.json`` shape: ``tokens_per_s``, ``bubble_ratio`` (steady state: the stage timers'
per-chunk bubble averaged over the timed chunks only, then over ranks; per rank in ``bubble_ratio_per_rank``),
``steps_per_job`` (timed optimizer steps per job, after warm-up), ``peak_mem_gib`` (per rank), ``device``,
``commit``, ``command``, and the baselines of ``--ablate`` beside them. ``--flush-per-batch`` runs the
"scheduler off" baseline with ``scheduler.lookahead_batches=1``: a pipeline flush per global batch, the
Megatron-LM way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from _bench import family  # (scripts/ is on sys.path: this file runs as a script)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
DIST = WORLD > 1  # under torchrun: every rank runs, rank 0 reports


def gather(obj) -> list:
    """``obj`` of every rank (rank order); ``[obj]`` in one process."""
    import torch.distributed as dist

    if not (DIST and dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class BubbleRecorder:
    """A trainer callback: the stage timers' bubble ratio of every chunk of this rank (the trainer computes
    one per chunk when pp > 1; its summary keeps only their mean over all chunks, warm-up included)."""

    def __init__(self):
        self.values = []

    def chunk_end(self, trainer, chunk, record):
        self.values.append(record["bubble"])


def ensure_data(rows: int) -> None:
    if all((ROOT / "data/bench" / f"{n}.jsonl").is_file() for n in ("short", "medium", "long", "mixed")):
        return
    import subprocess

    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_bench_data.py"), "--out", str(ROOT / "data/bench"),
         "--rows", str(rows)], check=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ChunkProfiler:
    """A trainer callback: profile one planned chunk of a trainer run (CUDA kernels and host activity) and
    summarise it: GPU busy fraction over the chunk, idle gaps, and the top kernels by GPU time."""

    def __init__(self, chunk_index: int):
        self.chunk_index, self.calls, self.summary, self._prof = chunk_index, 0, None, None

    def chunk_start(self, trainer, chunk):
        i = self.calls
        self.calls += 1
        if i != self.chunk_index or not torch.cuda.is_available():
            return
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        # CUDA activity alone unless BENCH_PROFILE_CPU=1: a whole chunk's host events take minutes to parse
        cpu = [ProfilerActivity.CPU] if os.environ.get("BENCH_PROFILE_CPU") else []
        acts = [ProfilerActivity.CUDA] + cpu
        self._prof = profile(activities=acts)
        self._prof.__enter__()

    def chunk_ran(self, trainer, chunk, result):
        if self._prof is None:
            return
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self.summary = summarise_profile(self._prof)
        self._prof = None


def summarise_profile(p, top: int = 20) -> dict:
    kern = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and e.time_range.elapsed_us() > 0]
    if not kern:
        return {}
    iv = sorted((e.time_range.start, e.time_range.end) for e in kern)
    t0, t1 = iv[0][0], max(e for _, e in iv)
    busy, gaps, cur_s, cur_e = 0.0, [], iv[0][0], iv[0][1]
    for s_, e_ in iv[1:]:
        if s_ > cur_e:
            busy += cur_e - cur_s
            gaps.append(s_ - cur_e)
            cur_s, cur_e = s_, e_
        else:
            cur_e = max(cur_e, e_)
    busy += cur_e - cur_s
    by_name: dict[str, list] = {}
    for e in kern:
        d = by_name.setdefault(e.name, [0.0, 0])
        d[0] += e.time_range.elapsed_us()
        d[1] += 1
    total = sum(v[0] for v in by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    big = [g for g in gaps if g >= 1000]
    families: dict[str, float] = {}
    for n, v in by_name.items():
        fam = family(n)
        families[fam] = families.get(fam, 0.0) + v[0] / 1e3
    return {"window_ms": (t1 - t0) / 1e3, "gpu_busy_frac": busy / max(1e-9, t1 - t0),
            "idle_gaps_ge_1ms": {"count": len(big), "total_ms": sum(big) / 1e3,
                                 "max_ms": max(big, default=0) / 1e3},
            "idle_gaps_lt_1ms_total_ms": sum(g for g in gaps if g < 1000) / 1e3,
            "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:90], "ms": v[0] / 1e3, "calls": v[1], "frac": v[0] / total}
                            for n, v in rows]}


class ChunkClock:
    """A trainer callback: host wall time from the start of each chunk to the pipeline's return (synchronised:
    the chunk's GPU work is done) and between chunks (chunk boundary: logging, checkpoints, waiting for the
    next plan)."""

    def __init__(self):
        self.inside: list[float] = []
        self.between: list[float] = []
        self._last_exit = self._t0 = None

    def chunk_start(self, trainer, chunk):
        self._t0 = time.perf_counter()
        if self._last_exit is not None:
            self.between.append(self._t0 - self._last_exit)

    def chunk_ran(self, trainer, chunk, result):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._last_exit = time.perf_counter()
        self.inside.append(self._last_exit - self._t0)
        if RANK == 0:  # progress: a run cut by its time limit still says how far it got
            print(f"bench: chunk {len(self.inside)} ran in {self.inside[-1]:.1f} s",
                  file=sys.stderr, flush=True)


class RunStopped(RuntimeError):
    """A trainer run ended on a stop signal (SIGTERM from ``timeout``: the bench's time limit), not at its
    last step: the trainer stops gracefully at the next chunk boundary, so the run returns with fewer
    steps."""


def _device_memory() -> dict:
    """This rank's GPU memory beyond torch's allocated peak: the allocator's reserved peak, the device's used
    memory now and what of it lies outside torch's allocator (CUDA context, NCCL buffers, cuBLAS/Triton)."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    used = (total - free) / 2**30
    return {"reserved_peak_gib": torch.cuda.max_memory_reserved() / 2**30, "device_used_gib": used,
            "outside_torch_gib": used - torch.cuda.memory_reserved() / 2**30}


def chunk_tokens(rows: list[dict], look: int) -> list[int]:
    """Tokens of each planned chunk, in order, from metrics.jsonl's rows (a chunk holds ``look`` optimizer
    steps of every job: steps ``c·look + 1 .. (c + 1)·look``)."""
    out: dict[int, int] = {}
    for r in rows:
        if r.get("step") and r.get("tokens") is not None:
            c = (r["step"] - 1) // look
            out[c] = out.get(c, 0) + r["tokens"]
    return [out.get(c, 0) for c in range(max(out, default=-1) + 1)]


def run_lorafusion(config: str, overrides: list[str], steps: int, warmup: int, out: Path,
                   only_job: int | None = None, profiler: ChunkProfiler | None = None,
                   background: bool = True) -> dict:
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    jobs = load_run_config(config).jobs  # (a warmup longer than the timed steps is refused: cut to them)
    composed = overrides + [f"output_dir={out}", "logging.progress=false", "logging.tensorboard=false"] \
        + [f"jobs.{i}.max_steps={steps}" for i in range(len(jobs))] \
        + [f"jobs.{i}.optimizer.warmup_steps={min(j.optimizer.warmup_steps, steps)}"
           for i, j in enumerate(jobs)]
    # each key once (the loader refuses a key given twice): the bench's own settings win over the command
    # line's
    cfg = load_run_config(config, list({o.partition("=")[0].strip(): o for o in composed}.values()))
    if only_job is not None:  # "scheduler off": this job alone through the same runtime
        cfg = cfg.model_copy(update={"jobs": [cfg.jobs[only_job]]})
    from bench_jit import JitClock  # (scripts/ is on sys.path: this file runs as a script)

    clock, rec = ChunkClock(), BubbleRecorder()
    look = cfg.scheduler.lookahead_batches
    if warmup < 1 or warmup % look or steps <= warmup:
        raise SystemExit(f"--warmup must be a positive multiple of scheduler.lookahead_batches ({look}) and "
                         "less than --steps: steps of one planned chunk finish together, so only whole "
                         "chunks can be timed")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
    jit = JitClock()  # Triton compilations per chunk: a timed chunk that compiles is not steady state
    try:
        trainer = Trainer(cfg, background_planning=background,
                          callbacks=[clock, rec, jit] + ([profiler] if profiler is not None else []))
        summary = trainer.run()
    finally:
        jit.close()
    first_timed = warmup // look  # chunks hold `look` global batches per job: chunks before this are warm-up
    steady = [b for b in rec.values[first_timed:] if b is not None]
    per_rank = gather(
        {"peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
         "bubble_steady": sum(steady) / len(steady) if steady else None,
         "bubble_per_chunk": rec.values, **_device_memory()})
    if RANK != 0:  # metrics.jsonl and the report are rank 0's
        del trainer
        gc.collect()
        return {}, {}, {}
    if summary["status"] == "stopped":  # (every rank: the ranks agree on a stop)
        done = {n: j["steps"] for n, j in summary["jobs"].items()}
        raise RunStopped(f"the run at {out} was stopped by {summary['stopped_by']} after "
                         f"{summary['windows']} chunk(s) (a time limit's SIGTERM?): steps per job {done}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in rows if r["step"] <= warmup]
    timed = [r for r in rows if r["step"] > warmup]
    if not warm or not timed:  # say what ran instead of max() of an empty list
        jobs = {n: {k: j.get(k) for k in ("status", "steps", "total_steps") if k in j}
                for n, j in summary["jobs"].items()}
        raise RuntimeError(f"no {'timed' if warm else 'warm-up'} steps to measure: {len(rows)} metrics rows, "
                           f"steps {sorted({r['step'] for r in rows})}, --warmup {warmup}, --steps {steps}; "
                           f"jobs {jobs}")
    t0 = max(r["elapsed_s"] for r in warm)
    t1 = max(r["elapsed_s"] for r in timed)
    res = {"tokens_per_s": sum(r["tokens"] for r in timed) / (t1 - t0),
           "timed_tokens": sum(r["tokens"] for r in timed),
           "timed_s": t1 - t0, "kernels": summary["kernels"], "noops": summary["noop_microbatches"],
           "plan_s": summary["plan_s"], "plan_wait_s": summary.get("plan_wait_s"),
           "chunk_s": [round(x, 3) for x in clock.inside], "boundary_s": [round(x, 3) for x in clock.between],
           "chunk_tokens": chunk_tokens(rows, look), "attention": summary["run_plan"].get("attention"),
           "token_capacity": summary["run_plan"].get("token_capacity"),
           "bubble_ratio": summary["bubble_ratio"],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
           "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries")
           if torch.cuda.is_available() else None,
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
           "final_loss": {n: j["final_loss"] for n, j in summary["jobs"].items()},
           "steps_per_job": {n: j["steps"] for n, j in summary["jobs"].items()},
           "timed_steps_per_job": {n: len([r for r in timed if r["job"] == n]) for n in summary["jobs"]},
           "parallelism": summary["parallelism"], "memory_plan": summary.get("memory_plan"),
           **jit.summary(first_timed)}
    if DIST or any(r["bubble_per_chunk"] for r in per_rank):
        res["peak_mem_gib_per_rank"] = [r["peak_mem_gib"] for r in per_rank]
        res["bubble_ratio_per_rank"] = [r["bubble_steady"] for r in per_rank]
        res["bubble_per_chunk_per_rank"] = [r["bubble_per_chunk"] for r in per_rank]
        for key in ("reserved_peak_gib", "device_used_gib", "outside_torch_gib"):
            res[f"{key}_per_rank"] = [r.get(key) for r in per_rank]
        known = [b for b in res["bubble_ratio_per_rank"] if b is not None]
        res["bubble_ratio_steady"] = sum(known) / len(known) if known else None
    batches = {n: [] for n in trainer.jobs}
    from lorafusion.data import JobStream

    for n, js in trainer.jobs.items():  # the same global batches, replayed for the baseline
        stream = JobStream(n, len(js.samples), js.cfg.global_batch_size, cfg.seed, max_steps=steps,
                           num_epochs=js.cfg.num_epochs)
        while (ids := stream.next_global_batch()) is not None:
            batches[n].append([js.samples[i] for i in ids])
    info = {"arch": trainer.arch, "capacity": trainer.plan.token_capacity,  # the run's resolved capacity
            "jobs": {n: js.cfg for n, js in trainer.jobs.items()}, "dtype": cfg.model.dtype}
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res, batches, info


def run_hf_peft(info: dict, batches: dict, warmup: int) -> dict:
    import peft
    import transformers

    from lorafusion.core.arch import arch_to_hf_config

    arch = info["arch"]
    cfgd = arch_to_hf_config(arch)
    cls = transformers.LlamaConfig if arch.family == "llama" else transformers.Qwen2Config
    cfgd.pop("model_type"), cfgd.pop("architectures")
    hf_cfg = cls(**cfgd, attn_implementation="sdpa")
    from lorafusion.models.base import DTYPES

    dtype = DTYPES[info["dtype"]]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = (transformers.LlamaForCausalLM if arch.family == "llama"
                 else transformers.Qwen2ForCausalLM)(hf_cfg)
    model = model.to(dtype)
    model.config.use_cache = False
    cap = info["capacity"]
    timed_tokens, timed_s, padded = 0, 0.0, 0
    for n, job_batches in batches.items():  # one adapter at a time
        jc = info["jobs"][n]
        from lorafusion.core.targets import to_peft_target_modules

        lcfg = peft.LoraConfig(r=jc.lora.r, lora_alpha=jc.lora.lora_alpha, lora_dropout=jc.lora.lora_dropout,
                               target_modules=to_peft_target_modules(jc.lora.target_modules),
                               task_type="CAUSAL_LM")
        pm = peft.get_peft_model(model, lcfg)
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=jc.optimizer.lr)
        for step, batch in enumerate(job_batches):
            sync()
            t0 = time.perf_counter()
            denom = sum(max(0, len(ids) - max(pl, 1)) for ids, pl in batch)
            mbs, cur = [], []
            for s in sorted(batch, key=lambda s: len(s[0])):
                if cur and (len(cur) + 1) * max(len(s[0]), max(len(c[0]) for c in cur)) > cap:
                    mbs.append(cur)
                    cur = []
                cur.append(s)
            mbs.append(cur)
            for mb in mbs:
                L = max(len(ids) for ids, _ in mb)
                ids = torch.zeros(len(mb), L, dtype=torch.long)
                labels = torch.full((len(mb), L), -100, dtype=torch.long)
                att = torch.zeros(len(mb), L, dtype=torch.long)
                for i, (toks, pl) in enumerate(mb):
                    ids[i, : len(toks)] = torch.tensor(toks)
                    att[i, : len(toks)] = 1
                    lab = torch.tensor(toks)
                    lab[: max(pl, 1)] = -100
                    labels[i, : len(toks)] = lab
                ids, labels, att = ids.to(dev), labels.to(dev), att.to(dev)
                logits = pm(input_ids=ids, attention_mask=att).logits.float()
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         labels[:, 1:].reshape(-1), ignore_index=-100,
                                                         reduction="sum") / max(1, denom)
                loss.backward()
                del logits, loss
                if step >= warmup:
                    padded += ids.numel()
            torch.nn.utils.clip_grad_norm_([p for p in pm.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if step >= warmup:
                timed_s += time.perf_counter() - t0
                timed_tokens += sum(len(ids) for ids, _ in batch)
        model = pm.unload()
        del pm, opt
    res = {"tokens_per_s": timed_tokens / timed_s, "timed_tokens": timed_tokens, "timed_s": timed_s,
           "padding_frac": 1 - timed_tokens / max(1, padded),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    del model
    gc.collect()
    return res


def _reset_between_runs() -> None:
    """Between two trainer runs of one bench: free the model; in one process also the process group (the
    next Trainer starts its own). Under torchrun the group stays (its rendezvous is torchrun's) and the next
    Trainer re-creates only Megatron's parallel state."""
    from lorafusion.dist import destroy_distributed

    if not DIST:
        destroy_distributed()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_results(result: dict, args, out: Path) -> None:
    """Rank 0: ``OUT/result.json`` and, with ``--scale-json``, the scale record (rewritten as results
    come)."""
    if RANK != 0:
        return
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.scale_json:
        Path(args.scale_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.scale_json).write_text(json.dumps(scale_record(result, args), indent=2, default=str) + "\n")


def scale_record(result: dict, args) -> dict:
    """The ``docs/results/*-gpu.json`` shape (see the module doc)."""
    ours = result["lorafusion"]
    rec = {"tokens_per_s": ours["tokens_per_s"], "bubble_ratio": ours.get("bubble_ratio_steady"),
           "steps_per_job": min(ours["timed_steps_per_job"].values()),
           "peak_mem_gib": ours.get("peak_mem_gib_per_rank", [ours["peak_mem_gib"]]),
           "device": result["device"], "commit": result["commit"], "command": result["command"],
           "world_size": WORLD, "parallelism": ours["parallelism"], "config": args.config,
           "overrides": list(args.overrides), "warmup_steps": args.warmup, "total_steps_per_job": args.steps,
           "kernels": ours["kernels"], "noop_microbatches": ours["noops"],
           "bubble_ratio_per_rank": ours.get("bubble_ratio_per_rank"),
           "bubble_ratio_all_chunks_rank0": ours["bubble_ratio"],
           "bubble_per_chunk_per_rank": ours.get("bubble_per_chunk_per_rank"),
           "timed_tokens": ours["timed_tokens"], "timed_s": ours["timed_s"],
           "memory_plan": ours.get("memory_plan"), "chunk_s": ours.get("chunk_s"),
           **{f"{k}_per_rank": ours.get(f"{k}_per_rank")
              for k in ("reserved_peak_gib", "device_used_gib", "outside_torch_gib")}}
    plan = ours.get("memory_plan") or {}
    if plan.get("stages"):
        rec["predicted_peak_gib"] = [s["predicted_peak_gib"] for s in plan["stages"]]
    if "baseline_steps" in result:
        rec["baseline_steps_per_job"] = result["baseline_steps"]  # {baseline: {steps, warmup}}
    for key in ("scheduler_off", "reference"):
        if key in result:
            rec[key] = result[key]
            rec[f"speedup_vs_{key}"] = ours["tokens_per_s"] / result[key]["tokens_per_s"]
        elif f"{key}_error" in result:
            rec[f"{key}_error"] = result[f"{key}_error"]
    return rec


def main() -> None:
    from lorafusion.core.procenv import set_process_env
    from lorafusion.runtime.signals import install_stack_dump

    set_process_env()  # the allocator and OpenMP settings `lorafusion train` runs with
    install_stack_dump()  # kill -USR2: every thread's stack (scripts/device/watch.sh)
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama3.1-8b-4adapters.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--out", default="results/bench_train")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="also kernels=reference and one job at a time")
    ap.add_argument("--flush-per-batch", action="store_true",
                    help="one-job-at-a-time baseline with scheduler.lookahead_batches=1 (a flush per global "
                         "batch)")
    ap.add_argument("--profile", action="store_true", help="profile the first timed chunk of our run")
    ap.add_argument("--baselines", default="reference,scheduler_off",
                    help="with --ablate: which ones, in this order (comma-separated)")
    ap.add_argument("--baseline-timed-steps", type=int,
                    help="with --ablate: timed steps per job of each baseline, after one untimed chunk "
                         "(default: --steps and --warmup as ours)")
    ap.add_argument("--no-background", action="store_true", help="plan each chunk when it is needed")
    ap.add_argument("--scale-json", help="also write the docs/results scale record here (rank 0)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if "data/bench" in Path(args.config).read_text():  # the shipped bench configs read data/bench
        if RANK == 0:
            ensure_data(args.rows)
        if DIST:  # the other ranks wait for rank 0's files
            deadline = time.time() + 600
            while not all((ROOT / "data/bench" / f"{n}.jsonl").is_file()
                          for n in ("short", "medium", "long", "mixed")):
                if time.time() > deadline:
                    raise SystemExit("data/bench was not written by rank 0")
                time.sleep(1)
            time.sleep(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"config": args.config, "device": f"{WORLD}x {device}" if DIST else device, "steps": args.steps,
              "warmup": args.warmup, "world_size": WORLD,
              "command": os.environ.get("BENCH_COMMAND") or " ".join(
                  ([f"torchrun --nproc_per_node {WORLD}"] if DIST else ["python"]) + sys.argv)}
    try:
        import subprocess

        result["commit"] = os.environ.get("BENCH_COMMIT") or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip() or None
    except OSError:
        result["commit"] = None
    ours = None
    from lorafusion.config import load_run_config

    base_cfg = load_run_config(args.config, list(args.overrides))
    result["token_capacity"] = base_cfg.scheduler.token_capacity
    look = base_cfg.scheduler.lookahead_batches
    profiler = ChunkProfiler(args.warmup // look) if args.profile else None
    for attempt, extra in enumerate(([], ["kernels=reference"])):
        try:
            ours, batches, info = run_lorafusion(args.config, list(args.overrides) + extra, args.steps,
                                                 args.warmup, out / f"ours{attempt}", profiler=profiler,
                                                 background=not args.no_background)
            result["lorafusion"] = ours
            if profiler is not None:
                result["profile"] = profiler.summary
            break
        except Exception as e:
            if DIST:  # the ranks would not agree on a retry: fail the launch (torchrun stops the others)
                raise
            traceback.print_exc()
            result[f"lorafusion_error_{attempt}"] = traceback.format_exc(limit=4)
            _reset_between_runs()
            if isinstance(e, RunStopped):  # a stop signal (the time limit) is no reason to retry
                break
    if ours is None:
        print(json.dumps(result, default=str))
        return
    from lorafusion.dist import destroy_distributed

    write_results(result, args, out)  # now and after each baseline: a run cut short keeps what it measured
    if args.ablate:
        _reset_between_runs()
        one_at_a_time = ["scheduler.lookahead_batches=1"] if args.flush_per_batch else []
        known = {"reference": dict(overrides=["kernels=reference"], jobs=[None]),
                 "scheduler_off": dict(overrides=one_at_a_time, jobs=list(range(len(base_cfg.jobs))))}
        chosen = [k for k in args.baselines.split(",") if k]
        if unknown := [k for k in chosen if k not in known]:
            raise SystemExit(f"--baselines: unknown {unknown}; expected some of {sorted(known)}")
        for key in chosen:
            spec = known[key]
            b_steps, b_warm = args.steps, args.warmup
            # one chunk (of this baseline's lookahead) of warm-up, then whole chunks
            if args.baseline_timed_steps:
                look_b = 1 if "scheduler.lookahead_batches=1" in spec["overrides"] else look
                b_warm = look_b
                b_steps = b_warm + -(-args.baseline_timed_steps // look_b) * look_b
            result.setdefault("baseline_steps", {})[key] = {"steps": b_steps, "warmup": b_warm}
            try:
                parts = []
                for j in spec["jobs"]:
                    tag = key if j is None else f"{key}_{j}"
                    r, _, _ = run_lorafusion(args.config, list(args.overrides) + spec["overrides"], b_steps,
                                             b_warm, out / tag, only_job=j)
                    parts.append(r)
                    _reset_between_runs()
                if RANK != 0:
                    continue
                toks, secs = sum(p["timed_tokens"] for p in parts), sum(p["timed_s"] for p in parts)
                result[key] = {"tokens_per_s": toks / secs, "timed_tokens": toks, "timed_s": secs,
                               "peak_mem_gib": max((p["peak_mem_gib"] or 0) for p in parts),
                               "kernels": parts[0]["kernels"], "runs": len(parts),
                               "overrides": spec["overrides"]}
                if "peak_mem_gib_per_rank" in parts[0]:
                    result[key]["peak_mem_gib_per_rank"] = [
                        max(p["peak_mem_gib_per_rank"][r] or 0 for p in parts)
                        for r in range(len(parts[0]["peak_mem_gib_per_rank"]))]
                    steady = [p["bubble_ratio_steady"] for p in parts
                              if p.get("bubble_ratio_steady") is not None]
                    result[key]["bubble_ratio"] = sum(steady) / len(steady) if steady else None
                write_results(result, args, out)
            except Exception as e:
                if DIST:
                    raise
                traceback.print_exc()
                result[f"{key}_error"] = traceback.format_exc(limit=4)
                destroy_distributed()
                if isinstance(e, RunStopped):  # the time limit: no more baselines (they would run past it)
                    write_results(result, args, out)
                    break
    if not args.skip_hf and not DIST:
        # HF+PEFT materialises the logits and pads: at our capacity it may not fit. Then it gets its best
        # chance: the largest capacity (halving from ours) that runs, recorded with the result.
        cap = info["capacity"]
        while cap >= 1024:
            try:
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                result["hf_peft"] = run_hf_peft(dict(info, capacity=cap), batches, args.warmup)
                result["hf_peft"]["token_capacity"] = cap
                result["speedup"] = ours["tokens_per_s"] / result["hf_peft"]["tokens_per_s"]
                break
            except torch.OutOfMemoryError:
                result.setdefault("hf_peft_oom_at", []).append(cap)
            except Exception:
                traceback.print_exc()
                result["hf_peft_error"] = traceback.format_exc(limit=3)
                break
            cap //= 2  # (outside the handler: the failed attempt's frames, and its model, are released)
            gc.collect()
            torch.cuda.empty_cache()
    destroy_distributed()  # before printing: the JSON must stay the last line
    if RANK != 0:
        return
    write_results(result, args, out)
    print(f"{'system':<22} {'tokens/s':>10} {'peak GiB':>9} {'bubble':>7}")
    for key in ("lorafusion", "reference", "scheduler_off", "hf_peft"):
        if key in result:
            r = result[key]
            bub = r.get("bubble_ratio_steady", r.get("bubble_ratio"))
            print(f"{key:<22} {r['tokens_per_s']:>10,.0f} {r['peak_mem_gib'] or 0:>9.1f} "
                  f"{'-' if bub is None else format(bub, '.3f'):>7}")
    if result.get("profile"):
        pr = result["profile"]
        print(f"profile: window {pr['window_ms']:.0f} ms, GPU busy {pr['gpu_busy_frac']:.3f}, "
              f"gaps>=1ms {pr['idle_gaps_ge_1ms']}")
        print("  by family (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in pr.get("families_ms", {}).items()))
        for row in pr["top_kernels"]:
            print(f"  {row['ms']:>9.1f} ms {row['calls']:>6} {row['frac']:>6.3f}  {row['name']}")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
