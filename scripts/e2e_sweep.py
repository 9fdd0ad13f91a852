"""The shipped config's ``auto`` capacity beside hand-picked capacities and base precisions, one fresh process
per run, in a given order: is the memory model's choice within 3% of the best hand-picked capacity on the same
GPU, and how does the FP8 base compare with bf16 at their own ``auto``?

    python scripts/e2e_sweep.py --order auto,24576,20480,auto --out $OUT/e2e --json $OUT/e2e-summary.json
    python scripts/e2e_sweep.py --order bf16:auto,fp8:auto,bf16:auto,fp8:auto --timed-chunks 3 \
        --out $OUT/e2e --json $OUT/e2e-8b-1xh100.json

An entry of ``--order`` is ``[PRECISION:]CAPACITY``: PRECISION ``bf16`` or ``fp8`` (``model.base_precision``;
none: the config's), CAPACITY ``auto`` (the config's token capacity and recompute as shipped), a number (that
``scheduler.token_capacity`` without recompute) or ``bf16cap`` (the capacity the sweep's first bf16 ``auto``
run resolved to, without recompute: FP8 at bf16's capacity), then optionally ``+KEY=VALUE`` overrides of that
entry's runs (e.g. ``bf16:auto+model.attention=fa2``); ``--overrides`` apply to every run. Runs of one entry
are pooled: each timed chunk's tokens/s (its tokens over its time, ``chunk_tokens`` / ``chunk_s`` of
scripts/bench_train.py) gives ``per_chunk``'s median and spread per configuration, beside each process's
tokens/s; alternate the entries (A, B, A, B) so that a drift of the GPU's clock or temperature falls on both.
Every process runs with the CLI's process environment (lorafusion.core.procenv: the allocator settings),
recorded as ``env``.

Every run is ``scripts/bench_train.py --config CONFIG --rows R --steps S --warmup W --skip-hf`` in its own
process: ``auto`` as shipped (``token_capacity`` and ``recompute_layers`` auto), a number as that
``scheduler.token_capacity`` without recompute. Order effects are what this guards against: the first process
of a call compiles every Triton kernel (later ones load them from the disk cache), and a timed chunk that
meets a new microbatch shape compiles inside the timing (each run records ``jit_timed_s``,
scripts/bench_jit.py); the GPU may also be colder at the start (its SM clock and temperature are read before
each run). Alternate the order (e.g. auto first and last) and compare the medians of each configuration; the
summary gives the ratio over all runs and over the runs that did not start the call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import command, commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lorafusion.core.procenv import PROCESS_ENV  # noqa: E402

HAND = ["model.recompute=false", "model.recompute_layers=null"]
PRECISIONS = ("bf16", "fp8")


def parse_spec(spec: str) -> tuple[str | None, str]:
    """``[PRECISION:]CAPACITY[+KEY=VALUE...]`` -> (precision or None, "auto" | "bf16cap" | digits); SystemExit
    if neither (or an override without ``=``)."""
    base, *extra = spec.split("+")
    if any("=" not in o for o in extra):
        raise SystemExit(f"--order: {spec!r}: what follows + must be KEY=VALUE overrides")
    prec, _, cap = base.rpartition(":")
    if (prec and prec not in PRECISIONS) or not (cap in ("auto", "bf16cap") or cap.isdigit()):
        raise SystemExit(f"--order: {spec!r} is neither auto nor a token capacity (optionally after "
                         f"{' or '.join(PRECISIONS)}:)")
    return prec or None, cap


def run_name(spec: str) -> str:
    prec, cap = parse_spec(spec)
    extra = "".join("+" + o for o in spec.split("+")[1:])
    if prec is None:
        return ("auto" if cap == "auto" else f"hand{cap}" if cap.isdigit() else cap) + extra
    return f"{prec}-{cap}{extra}"


def spec_overrides(spec: str, bf16_capacity: int | None) -> list[str]:
    """The bench's overrides for one entry (``bf16cap``: the capacity a bf16 ``auto`` run resolved to)."""
    prec, cap = parse_spec(spec)
    out = [] if prec is None else [f"model.base_precision={prec}"]
    if cap == "bf16cap":
        if bf16_capacity is None:
            raise SystemExit(f"--order: {spec} needs a bf16 auto run before it")
        cap = str(bf16_capacity)
    hand = [] if cap == "auto" else [f"scheduler.token_capacity={int(cap)}", *HAND]
    return out + hand + spec.split("+")[1:]


def gpu_state() -> str | None:
    """SM clock, temperature and power draw now (nvidia-smi), or None without one."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_record(index: int, spec: str, bench: dict | None, wall_s: float, gpu: str | None, rc: int,
               warmup_chunks: int = 1) -> dict:
    """One run's row: the resolved capacity, tokens/s, chunk times and Triton work in its timed chunks, and
    each timed chunk's tokens/s (the chunks after the ``warmup_chunks`` first)."""
    ours = (bench or {}).get("lorafusion") or {}
    plan = ours.get("memory_plan") or {}
    stages = plan.get("stages") or [{}]
    cap = parse_spec(spec)[1]
    secs, toks = ours.get("chunk_s") or [], ours.get("chunk_tokens") or []
    rates = [round(t / c, 1) for c, t in list(zip(secs, toks))[warmup_chunks:] if c > 0 and t > 0]
    return {"index": index, "name": run_name(spec), "spec": spec, "rc": rc, "wall_s": round(wall_s, 1),
            "gpu_before": gpu, "precision": parse_spec(spec)[0],
            "token_capacity": plan.get("token_capacity") or ours.get("token_capacity")
            or (int(cap) if cap.isdigit() else None),
            "tokens_per_s": ours.get("tokens_per_s"), "chunk_s": ours.get("chunk_s"),
            "chunk_tokens": ours.get("chunk_tokens"), "chunk_tokens_per_s": rates,
            "attention": ours.get("attention"),
            "jit_timed_n": ours.get("jit_timed_n"), "jit_timed_s": ours.get("jit_timed_s"),
            "jit_per_chunk": ours.get("jit_per_chunk"), "peak_mem_gib": ours.get("peak_mem_gib"),
            "reserved_gib": ours.get("reserved_gib"), "alloc_retries": ours.get("alloc_retries"),
            "predicted_peak_gib": stages[0].get("predicted_peak_gib")}


def spread(values: list[float]) -> dict:
    """Median, extremes and spread (max - min over the median, and the sample standard deviation over the
    mean, in percent) of some tokens/s."""
    if not values:
        return {"n": 0}
    med = statistics.median(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"n": len(values), "median": round(med, 1), "min": min(values), "max": max(values),
            "range_pct": round(100 * (max(values) - min(values)) / med, 2),
            "stdev_pct": round(100 * sd / statistics.fmean(values), 2)}


def per_chunk(runs: list[dict]) -> dict:
    """Per configuration the pooled timed chunks' tokens/s (:func:`spread`) and, where both bf16 and fp8
    ``auto`` ran, fp8's median over bf16's."""
    pooled: dict[str, list[float]] = {}
    for r in runs:
        pooled.setdefault(r["name"], []).extend(r.get("chunk_tokens_per_s") or [])
    out = {"per_config": {n: spread(v) for n, v in pooled.items()}}
    med = {n: v.get("median") for n, v in out["per_config"].items()}
    for name in med:
        if name.startswith("fp8-") and med[name] and med.get("bf16-auto"):
            out[f"{name}_over_bf16-auto"] = round(med[name] / med["bf16-auto"], 4)
    return out


def summarise(runs: list[dict], target: float = 0.97) -> dict:
    """Per configuration the runs' tokens/s and their median; auto's median over the best hand-picked median,
    over all runs and over the runs other than the call's first (the one that compiled)."""
    def table(rows):
        per: dict[str, list[float]] = {}
        for r in rows:
            if r["tokens_per_s"]:
                per.setdefault(r["name"], []).append(round(r["tokens_per_s"]))
        return {n: {"tokens_per_s": v, "median": statistics.median(v)} for n, v in per.items()}

    def ratio(per):
        hand = {n: v["median"] for n, v in per.items() if n.startswith("hand")}
        if "auto" not in per or not hand:
            return None, None
        best = max(hand, key=hand.get)
        return best, round(per["auto"]["median"] / hand[best], 4)

    out = {"order": [r["name"] for r in runs], "per_config": table(runs)}
    out["best_hand_picked"], out["auto_over_best_hand_picked"] = ratio(out["per_config"])
    rest = table(runs[1:])
    out["excluding_first_run"] = dict(zip(("best_hand_picked", "auto_over_best_hand_picked"), ratio(rest)),
                                      per_config=rest, first_run=runs[0]["name"] if runs else None)
    r_all = out["auto_over_best_hand_picked"]
    r_rest = out["excluding_first_run"]["auto_over_best_hand_picked"]
    out["within_3pct"] = None if r_all is None else r_all >= target
    out["within_3pct_excluding_first_run"] = None if r_rest is None else r_rest >= target
    auto_caps = {r["token_capacity"] for r in runs if r["name"] == "auto"}
    out["auto_token_capacity"] = sorted(c for c in auto_caps if c is not None)
    out["capacity_per_config"] = {n: sorted({r["token_capacity"] for r in runs if r["name"] == n
                                             and r["token_capacity"] is not None}) for n in out["per_config"]}
    out["per_chunk"] = per_chunk(runs)
    return out


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--order", required=True,
                    help="comma-separated [bf16:|fp8:](auto|bf16cap|CAPACITY), e.g. auto,24576,auto or "
                         "bf16:auto,fp8:auto,bf16:auto,fp8:auto")
    ap.add_argument("--config", default="configs/llama3.1-8b-4adapters.yaml")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timed-chunks", type=int,
                    help="timed chunks per run (sets --steps to --warmup + this many chunks of steps)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--out", required=True, help="a folder for each run's log")
    ap.add_argument("--json", help="the summary (default OUT/summary.json)")
    ap.add_argument("--overrides", nargs="*", default=[], help="KEY=VALUE overrides for every run")
    args = ap.parse_args()
    args.specs = [s.strip() for s in args.order.split(",") if s.strip()]
    for s in args.specs:
        parse_spec(s)
    from lorafusion.config import load_run_config

    args.look = load_run_config(ROOT / args.config, check_files=False).scheduler.lookahead_batches
    if args.timed_chunks is not None:
        args.steps = args.warmup + args.timed_chunks * args.look
    return args


def _run_one(i: int, spec: str, args, runs: list[dict], out: Path, env: dict) -> dict:
    name, gpu = run_name(spec), gpu_state()
    bf16cap = next((r["token_capacity"] for r in runs
                    if parse_spec(r["spec"]) == ("bf16", "auto") and r["token_capacity"]), None)
    cmd = [sys.executable, str(ROOT / "scripts/bench_train.py"), "--config", args.config,
           "--rows", str(args.rows), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--skip-hf", "--out", tempfile.mkdtemp(prefix=f"e2e_{i}_"), *args.overrides,
           *spec_overrides(spec, bf16cap)]
    log_path = out / re.sub(r"[^A-Za-z0-9._-]", "_", f"{i}-{name}.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                cwd=ROOT, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    shutil.rmtree(cmd[cmd.index("--out") + 1], ignore_errors=True)  # the run's own folder (adapters)
    lines = log_path.read_text().strip().splitlines()
    try:
        bench = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        bench = None
    r = run_record(i, spec, bench, time.perf_counter() - t0, gpu, rc, args.warmup // args.look)
    r["device"] = (bench or {}).get("device")
    print(f"run {i} {name}: rc={rc} cap={r['token_capacity']} tok/s={r['tokens_per_s'] or 0:,.0f} "
          f"chunk tok/s={r['chunk_tokens_per_s']} attention={r['attention']} "
          f"jit_timed={r['jit_timed_n']}/{r['jit_timed_s']}s peak={r['peak_mem_gib']} gpu=[{gpu}] "
          f"wall={r['wall_s']}s", flush=True)
    return r


def main() -> None:
    args = _args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in PROCESS_ENV.items()}}
    runs: list[dict] = []
    for i, spec in enumerate(args.specs):
        runs.append(_run_one(i, spec, args, runs, out, env))
        devices = sorted({r["device"] for r in runs if r.get("device")})
        summary = {"config": args.config, "command": command(), "commit": commit(), "device": devices,
                   "env": {k: env[k] for k in PROCESS_ENV}, "steps": args.steps, "warmup": args.warmup,
                   "timed_chunks_per_run": (args.steps - args.warmup) // args.look, "runs": runs,
                   **summarise(runs)}
        Path(args.json or out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("order", "auto_token_capacity", "best_hand_picked",
                                              "auto_over_best_hand_picked", "within_3pct", "per_chunk")}
                     | {"excluding_first_run": summary["excluding_first_run"]["auto_over_best_hand_picked"]}))


if __name__ == "__main__":
    main()
