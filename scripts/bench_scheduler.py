#!/usr/bin/env python3
"""Benchmark the lorafusion scheduler (CPU only, torch-free).

Setup: 4 jobs × ``--gbs`` (64) samples per global batch, ``--batches`` (8) global batches per job.
Sample lengths are lognormal, parameterised by their mean and sigma, rounded, clipped to [16, 4096]:

    short  mean  300, sigma 0.6      medium mean  800, sigma 0.6      long mean 1600, sigma 0.6
    mix    each sample from short / medium / long with probability 1/3

Scenarios: "short", "medium", "long" (4 jobs of that profile) and "mixed" (one short, one medium,
one long, one mix job). ``--lengths FILE`` (repeatable) adds a scenario "files" whose jobs draw lengths
from the given files (one integer per line, or JSONL with "num_tokens" / "length" / "input_ids").
Capacities 4096, 8192, 16384; pipeline depth 1, 2, 4; DP 1.

Planning is online, as the runtime does it: one ``plan`` call per round (one global batch of every
job), each carrying the previous call's dependency state; ``plan_s`` is the wall time of one call with
``--milp-time-limit`` (0.3 s) as its MILP budget. Every plan is checked with ``verify_plan``.

Metrics per configuration:
  plan_s_p50 / plan_s_max  wall seconds of one planning call
  padding_frac  unused capacity / capacity over all real microbatches except the least-full microbatch
                of each group in each call (the group's tail)
  imbalance     max / mean tokens over all real microbatches
  bubble_lorafusion      simulated 1F1B bubble ratio of the planned 4-job stream
  bubble_single_adapter  the same jobs one at a time, no grouping: each global batch alone, its
                         optimizer step after a pipeline flush (Megatron's usual loop)
Simulation: default CostModel (a=1 ms, b=4 µs/token, c=2e-10 s/token², whole-model forward),
backward = 2 × forward, 0.2 ms p2p per stage hand-over. The cost constants are illustrative, not
measured on a GPU.

The last line of output is one JSON object for S=4: the six named keys for the ``--headline``
configuration (scenario mixed, capacity 16384 by default; plan times over its calls), plus the worst
case over every S=4 configuration of the run (``plan_s_max_all_s4``, ``padding_frac_worst_s4``,
``imbalance_worst_s4``). ``--balance even`` packs equal microbatches instead of full ones + a tail.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import run_info, write_json  # noqa: E402

from lorafusion.scheduler import (
    CostModel,
    JobSpec,
    OnlineScheduler,
    SchedulerConfig,
    bubble_ratio,
    plan,
    simulate_plan,
    verify_plan,
)

PROFILES = {"short": (300, 0.6), "medium": (800, 0.6), "long": (1600, 0.6)}
SCENARIOS = {
    "short": ["short"] * 4,
    "medium": ["medium"] * 4,
    "long": ["long"] * 4,
    "mixed": ["short", "medium", "long", "mix"],
}
MAX_LEN = 4096


def lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 16, MAX_LEN).astype(int)


def draw(rng: np.random.Generator, profile: str | list[int], n: int) -> list[int]:
    if isinstance(profile, list):
        return [int(x) for x in rng.choice(profile, n)]
    if profile == "mix":
        kinds = rng.choice(list(PROFILES), n)
        return [int(lognormal(rng, *PROFILES[k], 1)[0]) for k in kinds]
    return [int(x) for x in lognormal(rng, *PROFILES[profile], n)]


def read_lengths(path: str) -> list[int]:
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        if line[0] == "{":
            rec = json.loads(line)
            n = rec.get("num_tokens") or rec.get("length") or len(rec.get("input_ids", []))
        else:
            n = int(line)
        if n:
            out.append(min(int(n), MAX_LEN))
    return out


def make_jobs(profiles: list, gbs: int, batches: int, seed: int) -> list[JobSpec]:
    rng = np.random.default_rng(seed)
    jobs = []
    for k, prof in enumerate(profiles):
        name = f"job{k}-{prof if isinstance(prof, str) else 'file'}"
        gb = [[(f"{name}/{g}/{i}", n) for i, n in enumerate(draw(rng, prof, gbs))] for g in range(batches)]
        jobs.append(JobSpec(name, gb, gbs))
    return jobs


def padding_and_imbalance(plans, capacity: int) -> tuple[float, float]:
    unused = total = 0
    tokens = []
    for p in plans:
        real = sorted(mb.num_tokens for mb in p.microbatches if not mb.is_noop)
        tokens += real
        for t in real[len(p.stats.groups):]:
            unused += capacity - t
            total += capacity
    return (unused / total if total else 0.0), max(tokens) / statistics.mean(tokens)


def single_adapter_bubble(jobs, S: int, capacity: int, time_limit: float, cm: CostModel,
                          balance: str) -> float:
    busy = span = 0.0
    for job in jobs:
        for k, gb in enumerate(job.global_batches):
            one = JobSpec(job.name, [gb], job.global_batch_size, first_batch_index=k)
            cfg = SchedulerConfig(S, 1, capacity, time_limit, grouping=False, merge=False, balance=balance)
            (tl,) = simulate_plan(plan([one], cfg), cm)
            busy += sum(tl.busy)
            span += S * tl.makespan
    return 1.0 - busy / span


def run_config(jobs, S: int, capacity: int, args, cm: CostModel) -> dict:
    cfg = SchedulerConfig(S, 1, capacity, args.milp_time_limit, balance=args.balance)
    online = OnlineScheduler(cfg, cm)
    for j in jobs:
        online.add_job(j)
    times = []
    while True:
        t0 = time.perf_counter()
        p = online.plan_next(1)
        if p is None:
            break
        times.append(time.perf_counter() - t0)
    combined = online.combined()
    report = verify_plan(combined, jobs, S, 1)
    pad, imb = padding_and_imbalance(online.plans, capacity)
    return {
        "plan_times": times,
        "padding_frac": pad,
        "imbalance": imb,
        "noops": report.num_noops,
        "microbatches": report.num_microbatches - report.num_noops,
        "groups": online.plans[0].stats.groups,
        "milp_wins": sum(p.stats.pack_sources.get("milp", 0) for p in online.plans),
        "packings": sum(sum(p.stats.pack_sources.values()) for p in online.plans),
        "bubble_lorafusion": bubble_ratio(simulate_plan(combined, cm)),
        "bubble_single_adapter": single_adapter_bubble(jobs, S, capacity, args.milp_time_limit,
                                                       cm, args.balance),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--milp-time-limit", type=float, default=0.3)
    ap.add_argument("--capacities", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    ap.add_argument("--lengths", action="append", default=[], help="length file (repeatable)")
    ap.add_argument("--headline", default="mixed:16384")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--balance", choices=["fill", "even"], default="fill")
    ap.add_argument("--plots", default="", help="directory for Gantt/packing PNGs of the headline")
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args()

    scenarios = {s: SCENARIOS[s] for s in args.scenarios}
    if args.lengths:
        files = [read_lengths(f) for f in args.lengths]
        scenarios["files"] = [files[k % len(files)] for k in range(4)]
    cm = CostModel()
    rows = {}
    hdr = (f"{'scenario':8} {'cap':>6} {'S':>2} {'groups':>7} {'mbs':>5} {'noop':>4} {'milp':>7} "
           f"{'p50 s':>6} {'max s':>6} {'pad':>6} {'imbal':>6} {'bub1':>6} {'bubLF':>6}")
    print(hdr)
    for name, profiles in scenarios.items():
        jobs = make_jobs(profiles, args.gbs, args.batches, args.seed)
        for cap in args.capacities:
            for S in args.depths:
                r = run_config(jobs, S, cap, args, cm)
                rows[name, cap, S] = r
                print(f"{name:8} {cap:>6} {S:>2} {len(r['groups']):>7} {r['microbatches']:>5} "
                      f"{r['noops']:>4} {r['milp_wins']:>3}/{r['packings']:<3} "
                      f"{statistics.median(r['plan_times']):6.3f} {max(r['plan_times']):6.3f} "
                      f"{r['padding_frac']:6.3f} {r['imbalance']:6.3f} "
                      f"{r['bubble_single_adapter']:6.3f} {r['bubble_lorafusion']:6.3f}", flush=True)
    s4 = [r for (_, _, S), r in rows.items() if S == 4]
    hs, hc = args.headline.split(":")
    head = rows.get((hs, int(hc), 4))
    if not s4 or head is None:
        raise SystemExit("headline needs S=4 and the headline scenario/capacity in the run")
    if args.plots:
        render_headline(scenarios[hs], int(hc), args, cm)
    times = [t for r in s4 for t in r["plan_times"]]
    write_json({
        **run_info(),
        "plan_s_p50": round(statistics.median(head["plan_times"]), 4),
        "plan_s_max": round(max(head["plan_times"]), 4),
        "padding_frac": round(head["padding_frac"], 4),
        "imbalance": round(head["imbalance"], 4),
        "bubble_single_adapter": round(head["bubble_single_adapter"], 4),
        "bubble_lorafusion": round(head["bubble_lorafusion"], 4),
        "headline": f"{hs} capacity {hc} S=4 balance {args.balance}",
        "plan_s_max_all_s4": round(max(times), 4),
        "padding_frac_worst_s4": round(max(r["padding_frac"] for r in s4), 4),
        "imbalance_worst_s4": round(max(r["imbalance"] for r in s4), 4),
    }, args.out)


def render_headline(profiles, capacity: int, args, cm: CostModel) -> None:
    from lorafusion.scheduler import render_gantt, render_packing

    out = Path(args.plots)
    out.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(profiles, args.gbs, 2, args.seed)
    p = plan(jobs, SchedulerConfig(4, 1, capacity, args.milp_time_limit))
    (tl,) = simulate_plan(p, cm)
    render_gantt(p, tl, str(out / "gantt_lorafusion_s4.png"))
    render_packing(p, str(out / "packing_lorafusion_s4.png"))
    one = JobSpec(jobs[0].name, jobs[0].global_batches, jobs[0].global_batch_size)
    p1 = plan([one], SchedulerConfig(4, 1, capacity, args.milp_time_limit, grouping=False, merge=False))
    (tl1,) = simulate_plan(p1, cm)
    render_gantt(p1, tl1, str(out / "gantt_single_s4.png"))


if __name__ == "__main__":
    main()
