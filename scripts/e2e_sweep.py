"""The shipped config's ``auto`` capacity beside hand-picked capacities, one fresh process per run, in a given
order: is the memory model's choice within 3% of the best hand-picked capacity on the same GPU?

    python scripts/e2e_sweep.py --order auto,24576,20480,auto --out $OUT/e2e --json $OUT/e2e-summary.json

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
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _bench import command, commit

ROOT = Path(__file__).resolve().parents[1]
HAND = ["model.recompute=false", "model.recompute_layers=null"]


def run_name(spec: str) -> str:
    return "auto" if spec == "auto" else f"hand{int(spec)}"


def gpu_state() -> str | None:
    """SM clock, temperature and power draw now (nvidia-smi), or None without one."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_record(index: int, spec: str, bench: dict | None, wall_s: float, gpu: str | None, rc: int) -> dict:
    """One run's row: the resolved capacity, tokens/s, chunk times and Triton work in its timed chunks."""
    ours = (bench or {}).get("lorafusion") or {}
    plan = ours.get("memory_plan") or {}
    stages = plan.get("stages") or [{}]
    return {"index": index, "name": run_name(spec), "rc": rc, "wall_s": round(wall_s, 1), "gpu_before": gpu,
            "token_capacity": plan.get("token_capacity", None if spec == "auto" else int(spec)),
            "tokens_per_s": ours.get("tokens_per_s"), "chunk_s": ours.get("chunk_s"),
            "jit_timed_n": ours.get("jit_timed_n"), "jit_timed_s": ours.get("jit_timed_s"),
            "jit_per_chunk": ours.get("jit_per_chunk"), "peak_mem_gib": ours.get("peak_mem_gib"),
            "reserved_gib": ours.get("reserved_gib"),
            "predicted_peak_gib": stages[0].get("predicted_peak_gib")}


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
        hand = {n: v["median"] for n, v in per.items() if n != "auto"}
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
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--order", required=True,
                    help="comma-separated: auto or a token capacity, e.g. auto,24576,auto")
    ap.add_argument("--config", default="configs/llama3.1-8b-4adapters.yaml")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--out", required=True, help="a folder for each run's log")
    ap.add_argument("--json", help="the summary (default OUT/summary.json)")
    args = ap.parse_args()
    specs = [s.strip() for s in args.order.split(",") if s.strip()]
    for s in specs:
        if s != "auto" and not s.isdigit():
            raise SystemExit(f"--order: {s!r} is neither auto nor a token capacity")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, spec in enumerate(specs):
        name, gpu = run_name(spec), gpu_state()
        cmd = [sys.executable, str(ROOT / "scripts/bench_train.py"), "--config", args.config,
               "--rows", str(args.rows), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--skip-hf", "--out", f"/tmp/e2e_{i}_{name}"]
        cmd += [] if spec == "auto" else [f"scheduler.token_capacity={int(spec)}", *HAND]
        t0 = time.perf_counter()
        with open(out / f"{i}-{name}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    cwd=ROOT).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        lines = (out / f"{i}-{name}.log").read_text().strip().splitlines()
        try:
            bench = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            bench = None
        runs.append(run_record(i, spec, bench, time.perf_counter() - t0, gpu, rc))
        r = runs[-1]
        print(f"run {i} {name}: rc={rc} cap={r['token_capacity']} tok/s={r['tokens_per_s'] or 0:,.0f} "
              f"chunks={r['chunk_s']} jit_timed={r['jit_timed_n']}/{r['jit_timed_s']}s "
              f"peak={r['peak_mem_gib']} gpu=[{gpu}] wall={r['wall_s']}s", flush=True)
    summary = {"config": args.config, "command": command(), "commit": commit(), "runs": runs,
               **summarise(runs)}
    Path(args.json or out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("order", "auto_token_capacity", "best_hand_picked",
                                              "auto_over_best_hand_picked", "within_3pct")}
                     | {"excluding_first_run": summary["excluding_first_run"]["auto_over_best_hand_picked"]}))


if __name__ == "__main__":
    main()
