"""Four adapters in one packed microbatch vs one adapter over the same tokens: forward + backward of
the whole LLaMA-3.1-8B-shaped model (bf16, the layers' fused LoRA path as training runs it, fused loss) on one
microbatch of realistic samples (the four bench datasets' lognormal lengths packed up to ``--tokens``), the
same samples and model every time; only the routing differs:

  one_r16   every sample trains one r=16 adapter (what "one job at a time" runs per microbatch)
  four_r16  the samples in four contiguous groups, one r=16 adapter each (what packing four jobs runs)
  one_r64   one r=64 adapter (the same total rank as the four)
  four_r16_shared_a  as four_r16 with one A shared by the projections of a fused linear (q/k/v, gate/up)
            instead of PEFT's A per projection (not in the default ``--variants``)

Alternating variants, CUDA events, ``--warmup`` calls, median of ``--iters``. ``--profile``: then one profiled
step per variant (torch.profiler): GPU time by kernel family and the kernels that differ most between
four_r16 and one_r16. Prints a table, last line JSON.

    python3 scripts/bench_model_step.py --tokens 12288 --profile --out /tmp/model_step.json
    python3 scripts/bench_model_step.py --variants four_r16,four_r16_shared_a --out /tmp/shared_a.json
    # CPU smoke test:
    python3 scripts/bench_model_step.py --preset tiny-llama --tokens 256 --layers 2 --iters 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from _bench import family, run_info, timed_ms, write_json

# name: (adapters, rank, one A shared by a fused linear's projections)
VARIANTS = {"one_r16": (1, 16, False), "four_r16": (4, 16, False), "one_r64": (1, 64, False),
            "four_r16_shared_a": (4, 16, True)}
DEFAULT_VARIANTS = ("one_r16", "four_r16", "one_r64")
def sample_lengths(tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids of samples drawn round robin from the bench datasets' length profiles, up to ``tokens``."""
    from lorafusion.core.lengths import LENGTH_PROFILES

    gen = torch.Generator().manual_seed(seed)
    profiles = list(LENGTH_PROFILES.values())
    out, total = [], 0
    while True:
        med, sigma = profiles[len(out) % len(profiles)]
        n = int(min(4094, max(16, math.exp(math.log(med) + sigma * torch.randn((), generator=gen).item()))))
        if total + n > tokens:
            if out:
                break
            n = tokens  # a tiny smoke-test budget: one sample
        out.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
        total += n
    return out


def build(args, dev):
    """(model, {variant: (batch, seeds)}) with every variant's adapters added to one model."""
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.data import pack_microbatch
    from lorafusion.layers import adapter_parameters, add_adapter
    from lorafusion.models.provider import build_model

    arch = preset(args.preset, num_layers=args.layers)
    cuda = dev.type == "cuda"
    model = build_model(arch, params_dtype=torch.bfloat16 if cuda else torch.float32,
                        device=dev if cuda else None, seed=0)
    samples = sample_lengths(args.tokens, arch.vocab_size)
    batches = {}
    for v in args.variants:
        count, r, shared = VARIANTS[v]
        names = [f"{v}_{i}" for i in range(count)]
        for i, name in enumerate(names):
            add_adapter(model, name, LoRASpec(r=r, lora_alpha=2 * r, lora_dropout=0.1, shared_fused_a=shared),
                        seed=i)
            with torch.no_grad():
                for k, p in adapter_parameters(model, name).items():
                    if k.endswith("lora_B"):
                        p.normal_(0, 0.01)
        owner = [names[min(count - 1, i * count // len(samples))]
                 for i in range(len(samples))]  # contiguous groups
        batch = pack_microbatch(list(zip(owner, samples, strict=True)),
                                row_ids=list(range(len(samples)))).to(dev)
        batches[v] = (batch, list(range(count)))
    model.train()
    return model, batches, samples


def step(model, batch, seeds):
    from lorafusion.layers import lora_batch

    model.zero_grad(set_to_none=True)
    with lora_batch(model, batch.routing, batch.adapters, seeds):
        loss = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                     packed_seq_params=batch.packed_seq_params())
    loss.float().sum().backward()


def parse_settings(specs: list[str]) -> dict[str, dict[str, str]]:
    """``NAME:VAR=VALUE[,VAR=VALUE]`` → {"": {} (the shipped settings), "+NAME": {VAR: VALUE, ...}}."""
    out: dict[str, dict[str, str]] = {"": {}}
    for spec in specs:
        name, _, assigns = spec.partition(":")
        pairs = [a.partition("=") for a in assigns.split(",") if a]
        if not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
            raise SystemExit(f"--setting: expected NAME:VAR=VALUE[,VAR=VALUE], got {spec!r}")
        out["+" + name] = {k: v for k, _, v in pairs}
    return out


def apply_env(env: dict[str, str], all_vars: set[str]) -> None:
    """Exactly ``env`` among ``all_vars`` (the LoRA ops read LORAFUSION_TUNING_FILE / LORAFUSION_MAIN_GEMM at
    each call, so a setting applies from the next step on)."""
    import os

    for k in all_vars:
        if k in env:
            os.environ[k] = env[k]
        else:
            os.environ.pop(k, None)


def kernel_profile(fn) -> tuple[dict[str, float], dict]:
    """GPU ms of each kernel name over one call of ``fn`` (CUDA activity only: the host is not traced, so its
    pace is close to an unprofiled step's), and the timeline: the step's wall time (CUDA events around it),
    the kernels' busy time (union of their intervals) and the idle gaps between them."""
    from bench_train import summarise_profile  # (scripts/ is on sys.path: this file runs as a script)
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # (on a CPU: its ops, a smoke test of this code)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        wall = timed_ms(fn)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    by: dict[str, float] = {}
    for e in p.events():
        if e.device_type == kind:
            by[e.name[:80]] = by.get(e.name[:80], 0.0) + e.time_range.elapsed_us() / 1e3
    tl = summarise_profile(p, top=0)
    tl.pop("top_kernels", None)
    busy = tl.get("window_ms", 0.0) * tl.get("gpu_busy_frac", 0.0)
    return by, dict(tl, wall_ms=wall, busy_ms=busy, idle_ms=wall - busy)


def summarise(prof: dict[str, tuple[dict[str, float], dict]]) -> dict:
    out = {}
    for v, (by, timeline) in prof.items():
        fams: dict[str, float] = {}
        for name, ms in by.items():
            fams[family(name)] = fams.get(family(name), 0.0) + ms
        total = sum(by.values())
        out[v] = {"kernel_ms": total, "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
                  "families_frac": {f: ms / max(total, 1e-9)
                                    for f, ms in sorted(fams.items(), key=lambda kv: -kv[1])},
                  "timeline": timeline, "top": sorted(by.items(), key=lambda kv: -kv[1])[:20]}
    prof = {v: by for v, (by, _) in prof.items()}
    if "four_r16" in prof and "one_r16" in prof:
        a, b = prof["four_r16"], prof["one_r16"]
        diff = {n: a.get(n, 0.0) - b.get(n, 0.0) for n in set(a) | set(b)}
        out["four_minus_one_r16"] = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]
    return out


def stamp(t0: float, msg: str) -> None:
    # progress: a run cut by its limit says how far it got
    print(f"[+{time.perf_counter() - t0:.0f}s] {msg}", flush=True)


def print_profile(prof: dict) -> None:
    for v, p in prof.items():
        if v == "four_minus_one_r16":
            print("  four_r16 - one_r16 by kernel (ms): " + ", ".join(f"{n[:40]} {d:+.2f}" for n, d in p))
            continue
        tl = p["timeline"]
        print(f"  {v}: step {tl['wall_ms']:.1f} ms wall, kernels {p['kernel_ms']:.1f} ms, GPU busy "
              f"{tl['busy_ms']:.1f} ms → idle {tl['idle_ms']:.1f} ms "
              f"({tl['idle_ms'] / max(tl['wall_ms'], 1e-9):.1%}); gaps ≥ 1 ms {tl.get('idle_gaps_ge_1ms')}, "
              f"< 1 ms {tl.get('idle_gaps_lt_1ms_total_ms', 0):.1f} ms")
        print("    by family: " + ", ".join(f"{f} {ms:.1f} ms ({p['families_frac'][f]:.1%})"
                                            for f, ms in p["families_ms"].items()))
        for name, ms in p["top"]:
            print(f"    {ms:8.2f} ms {ms / max(p['kernel_ms'], 1e-9):6.1%}  {name}")
    sys.stdout.flush()


def report(args, samples, times, settings, name, cuda) -> dict:
    med = {v: statistics.median(t) for v, t in times.items() if t}
    ntok = sum(len(s) for s in samples)
    print(f"{name}: {args.preset} {args.layers} layers, {ntok} tokens in {len(samples)} samples")
    for v, t in times.items():
        if t:
            print(f"  {v:9s} fwd+bwd median {med[v]:8.1f} ms  tokens/s {ntok / med[v] * 1e3:8,.0f}  "
                  f"(all {', '.join(f'{x:.1f}' for x in t)})")
    rec = {**run_info(), "torch": torch.__version__, **vars(args), "tokens_packed": ntok,
           "samples": len(samples), "median_ms": med, "all_ms": times,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    ratio = lambda a, b: med[a] / med[b] if a in med and b in med else None  # noqa: E731
    rec["four_over_one_r16"] = ratio("four_r16", "one_r16")
    rec["four_over_one_r64"] = ratio("four_r16", "one_r64")
    rec["per_projection_a_over_shared_a"] = ratio("four_r16", "four_r16_shared_a")
    for tag in list(settings)[1:]:
        rec[f"{tag[1:]}_over_shipped"] = {v: ratio(v + tag, v) for v in args.variants}
        rec[f"four_over_one_r16{tag}"] = ratio("four_r16" + tag, "one_r16" + tag)
        print(f"  {tag[1:]} / shipped: {rec[f'{tag[1:]}_over_shipped']}; four_r16 / one_r16 with it "
              f"{rec[f'four_over_one_r16{tag}']}")
    print(f"  four_r16 / one_r16 {rec['four_over_one_r16']}   four_r16 / one_r64 {rec['four_over_one_r64']}")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--preset", default="llama3.1-8b", help="tiny-llama + a CPU: a smoke test of this script")
    ap.add_argument("--profile", action="store_true", help="one profiled step per variant right after the "
                    "warm-up (printed before the timed loop, so a run cut later still has it)")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds from the start: the timed loop stops after the round that passes it (0: no "
                         "limit)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="also time every variant with these environment settings "
                    "(LORAFUSION_TUNING_FILE=tuned.json, LORAFUSION_MAIN_GEMM=cublas_fold), alternating with "
                    "the shipped ones")
    ap.add_argument("--profile-setting", default="",
                    help="the setting NAME to profile under (default: shipped)")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        raise SystemExit(f"--variants: expected some of {list(VARIANTS)}, got {args.variants}")
    t0 = time.perf_counter()
    settings = parse_settings(args.setting)
    all_vars = {k for env in settings.values() for k in env}
    from lorafusion.dist import init_distributed

    init_distributed(1, 1)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name() if cuda else "CPU"
    model, batches, samples = build(args, dev)
    stamp(t0, f"built on {name}: {args.layers} layers, variants {args.variants}, settings {list(settings)}")
    runs = [(v, tag, env) for v in batches for tag, env in settings.items()]
    for it in range(args.warmup):
        for v, tag, env in runs:
            apply_env(env, all_vars)
            ms = timed_ms(lambda b=batches[v][0], s=batches[v][1]: step(model, b, s))
            stamp(t0, f"warm-up {it}: {v}{tag} {ms:.1f} ms")
    rec: dict = {}
    if args.profile:
        apply_env(settings.get("+" + args.profile_setting, {}), all_vars)
        rec["profile"] = summarise({v: kernel_profile(lambda b=b, s=s: step(model, b, s))
                                    for v, (b, s) in batches.items()})
        stamp(t0, f"profile (setting {args.profile_setting or 'shipped'}):")
        print_profile(rec["profile"])
    times: dict[str, list[float]] = {v + tag: [] for v, tag, _ in runs}
    for it in range(args.iters):
        if args.budget and time.perf_counter() - t0 > args.budget:
            stamp(t0, f"budget {args.budget:.0f}s spent: {it} of {args.iters} timed rounds")
            break
        for v, tag, env in runs:  # alternating: clocks and temperature drift hit all alike
            apply_env(env, all_vars)
            times[v + tag].append(timed_ms(lambda b=batches[v][0], s=batches[v][1]: step(model, b, s)))
    apply_env({}, all_vars)
    rec = dict(report(args, samples, times, settings, name, cuda), **rec)
    write_json(rec, args.out)


if __name__ == "__main__":
    main()
