"""End-to-end training throughput: lorafusion (N adapters at once) vs HF transformers + PEFT (one adapter at
a time, the way people run LoRA jobs today) on the same base shape, samples and LoRA settings, same device,
same run.

    python scripts/bench_train.py --config configs/llama3.1-8b-4adapters.yaml --steps 6 --out results/

Both sides train every job for ``--steps`` optimizer steps on identical global batches (the job streams of
the run config). Tokens/s counts real (unpadded) tokens and excludes the first ``--warmup`` steps of each
job. HF+PEFT pads each microbatch to its longest sample and packs samples into microbatches of at most
``token_capacity`` padded tokens. Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ensure_data(rows: int) -> None:
    if all((ROOT / "data/bench" / f"{n}.jsonl").is_file() for n in ("short", "medium", "long", "mixed")):
        return
    import subprocess

    subprocess.run([sys.executable, str(ROOT / "scripts/make_bench_data.py"), "--out", str(ROOT / "data/bench"),
                    "--rows", str(rows)], check=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_lorafusion(config: str, overrides: list[str], steps: int, warmup: int, out: Path) -> dict:
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    cfg = load_run_config(config, overrides + [f"output_dir={out}", "logging.progress=false",
                                               "logging.tensorboard=false"]
                          + [f"jobs.{i}.max_steps={steps}" for i in range(len(load_run_config(config).jobs))])
    look = cfg.scheduler.lookahead_batches
    if warmup < 1 or warmup % look or steps <= warmup:
        raise SystemExit(f"--warmup must be a positive multiple of scheduler.lookahead_batches ({look}) and less "
                         f"than --steps: steps of one planned chunk finish together, so only whole chunks can be timed")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    summary = trainer.run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in rows if r["step"] <= warmup]
    timed = [r for r in rows if r["step"] > warmup]
    t0 = max(r["elapsed_s"] for r in warm)
    t1 = max(r["elapsed_s"] for r in timed)
    res = {"tokens_per_s": sum(r["tokens"] for r in timed) / (t1 - t0), "timed_tokens": sum(r["tokens"] for r in timed),
           "timed_s": t1 - t0, "kernels": summary["kernels"], "noops": summary["noop_microbatches"],
           "plan_s": summary["plan_s"], "bubble_ratio": summary["bubble_ratio"],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
           "final_loss": {n: j["final_loss"] for n, j in summary["jobs"].items()}}
    batches = {n: [] for n in trainer.jobs}
    from lorafusion.data import JobStream

    for n, js in trainer.jobs.items():  # the same global batches, replayed for the baseline
        stream = JobStream(n, len(js.samples), js.cfg.global_batch_size, cfg.seed, max_steps=steps,
                           num_epochs=js.cfg.num_epochs)
        while (ids := stream.next_global_batch()) is not None:
            batches[n].append([js.samples[i] for i in ids])
    info = {"arch": trainer.arch, "capacity": cfg.scheduler.token_capacity,
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
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[info["dtype"]]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = (transformers.LlamaForCausalLM if arch.family == "llama" else transformers.Qwen2ForCausalLM)(hf_cfg)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama3.1-8b-4adapters.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--out", default="results/bench_train")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ensure_data(args.rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"config": args.config, "device": device, "steps": args.steps, "warmup": args.warmup}
    ours = None
    for attempt, extra in enumerate(([], ["kernels=reference"])):
        try:
            ours, batches, info = run_lorafusion(args.config, list(args.overrides) + extra, args.steps, args.warmup,
                                                 out / f"ours{attempt}")
            result["lorafusion"] = ours
            break
        except Exception:
            traceback.print_exc()
            result[f"lorafusion_error_{attempt}"] = traceback.format_exc(limit=4)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            from lorafusion.runtime.dist import destroy_distributed

            destroy_distributed()
    if ours is None:
        print(json.dumps(result, default=str))
        return
    if not args.skip_hf:
        try:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            result["hf_peft"] = run_hf_peft(info, batches, args.warmup)
            result["speedup"] = ours["tokens_per_s"] / result["hf_peft"]["tokens_per_s"]
        except Exception:
            traceback.print_exc()
            result["hf_peft_error"] = traceback.format_exc(limit=3)
    from lorafusion.runtime.dist import destroy_distributed

    destroy_distributed()  # before printing: the JSON must stay the last line
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{'system':<22} {'tokens/s':>10} {'peak GiB':>9}")
    for key in ("lorafusion", "hf_peft"):
        if key in result:
            r = result[key]
            print(f"{key:<22} {r['tokens_per_s']:>10,.0f} {r['peak_mem_gib'] or 0:>9.1f}")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
