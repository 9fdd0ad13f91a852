"""The pipeline simulator against the per-rank bubbles measured on GPUs (CPU only, no GPU).

For every 70B pipeline run (tp = 1, one model chunk per rank) that scripts/fit_stage_costs.py reads, the
chunks the run timed are planned again from the same data (scripts/make_bench_data.py at the runs' 256 rows,
seed 0, into a temporary directory; the planned tokens must equal the record's ``timed_tokens``) at its
capacity and lookahead, and simulated (:func:`lorafusion.scheduler.simulate_plan`): each microbatch's forward
from its GEMM and causal-attention FLOPs (unequal microbatches take unequal time), each stage's share from the
fitted stage cost model (``stages.recompute_stage_costs``: layers, FP8, recompute, loss, first rank), scaled
so the simulated busy time equals the measured one. Printed per run: the per-rank bubbles simulated and
measured, with no hand-over latency and with the latency per pipeline hand-over (grid 0-40 ms) that fits the
run best: a wait the layers' work does not explain (host work in line with the pipeline, e.g. a p2p shape
exchange).

``--split-check``: for the shipped 70B config as ``lorafusion plan`` resolves it on 80 GiB GPUs (bf16 and
fp8), every split within 2 layers of the chosen one (at the fewest recompute that fits) simulated on the real
data's second chunk: does the simulator's best split equal the chooser's (least busiest-rank work)?

    python scripts/sim_check_runs.py --split-check --out docs/results/pipeline-sim-check.json
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from _bench import run_info, write_json  # noqa: E402
from fit_stage_costs import load_runs  # noqa: E402
from sim_interleave import plan_chunks  # noqa: E402

from lorafusion.core.arch import preset  # noqa: E402
from lorafusion.core.precision import FP8_BF16_LEADING_LAYERS  # noqa: E402
from lorafusion.scheduler import simulate_plan, stages  # noqa: E402

CONFIG = "configs/llama3.1-70b-4adapters.yaml"
HOPS_MS = [2.5 * k for k in range(17)]


def _sim(plans, arch, split, rc, lead, hop_units: float) -> list[float]:
    """Per-rank bubble over ``plans`` (the simulated chunks back to back) and their busy time and span."""
    loss = stages.loss_layers(arch)
    costs = stages.recompute_stage_costs(split, loss, len(rc), rc, 2.0, lead, stages.embedding_layers())
    cm = stages.flop_cost_model(arch, loss, flops_per_s=1.0)
    tls = [simulate_plan(p, cm, backward_ratio=2.0, p2p_s=hop_units, stage_costs=costs)[0] for p in plans]
    span = sum(t.makespan for t in tls)
    busy = [sum(t.busy[r] for t in tls) for r in range(len(rc))]
    return [1 - b / span for b in busy] + [sum(busy), span]


def check_run(run, data: Path) -> dict | None:
    rec = run.record
    ov = list(rec.get("overrides") or [])
    if run.model != "llama3.1-70b" or len(run.split) != run.pp or any("tp=2" in o for o in ov):
        return None
    plan = rec.get("memory_plan") or {}
    look = int(next((o.split("=")[1] for o in ov if o.startswith("scheduler.lookahead_batches=")), 8))
    cap = plan.get("token_capacity") or int(next(o.split("=")[1] for o in ov
                                                 if o.startswith("scheduler.token_capacity=")))
    warm = rec["warmup_steps"] // look
    timed = rec["steps_per_job"] // look
    over = ["parallelism.dp=1", f"scheduler.token_capacity={cap}", f"scheduler.lookahead_batches={look}",
            "model.recompute=false", "model.recompute_layers=null"]
    over += [f"jobs.{n}.dataset.path={data / n}.jsonl" for n in ("short", "medium", "long", "mixed")]
    plans = plan_chunks(str(ROOT / CONFIG), over, warm + timed)[1][warm:]
    tokens = sum(mb.num_tokens for p in plans for mb in p.microbatches)
    if tokens != rec["timed_tokens"]:
        return {"run": run.name, "skipped": f"planned {tokens} tokens, the run timed {rec['timed_tokens']}"}
    arch, lead = preset(run.model), FP8_BF16_LEADING_LAYERS if run.precision == "fp8" else None
    meas = rec["bubble_ratio_per_rank"]
    base = _sim(plans, arch, list(run.split), list(run.recompute), lead, 0.0)
    units = base[-2] / sum(run.busy)  # simulated units per measured second of busy time
    rows = {h: _sim(plans, arch, list(run.split), list(run.recompute), lead, h / 1000 * units)[:run.pp]
            for h in HOPS_MS}

    def rms(b):
        return (sum((x - m) ** 2 for x, m in zip(b, meas, strict=True)) / len(b)) ** 0.5

    best = min(HOPS_MS, key=lambda h: rms(rows[h]))
    return {"run": run.name, "split": list(run.split), "recompute": list(run.recompute),
            "measured": [round(x, 4) for x in meas],
            "simulated_no_latency": [round(x, 4) for x in rows[0.0]],
            "rms_no_latency": round(rms(rows[0.0]), 4),
            "best_hop_latency_ms": best, "simulated_best": [round(x, 4) for x in rows[best]],
            "rms_best": round(rms(rows[best]), 4)}


def split_check(data: Path, precision: str, gpu_gib: float) -> dict:
    """The chooser's split against every split within 2 layers of it, simulated on the real second chunk."""
    from lorafusion.config import load_run_config
    from lorafusion.resolve import GpuMemory, World, resolve
    from lorafusion.scheduler.memory import GIB, load_coefficients
    from lorafusion.scheduler.sizing import _fewest, rank_loads

    cfg = load_run_config(ROOT / CONFIG, ["parallelism.dp=1", f"model.base_precision={precision}"],
                          check_files=False)
    run = resolve(cfg, World(4), GpuMemory(gpu_gib * GIB, gpu_gib * GIB))
    m, s, arch = run.memory, run.setup, preset("llama3.1-70b")
    over = ["parallelism.dp=1", f"scheduler.token_capacity={m.capacity}", "model.recompute=false",
            "model.recompute_layers=null"]
    over += [f"jobs.{n}.dataset.path={data / n}.jsonl" for n in ("short", "medium", "long", "mixed")]
    chunk = plan_chunks(str(ROOT / CONFIG), over, 2)[1][1:]
    lead = FP8_BF16_LEADING_LAYERS if precision == "fp8" else None
    rows = []
    for d in itertools.product(range(-2, 3), repeat=3):
        split = [m.stage_layers[k] + d[k] for k in range(3)]
        split.append(s.arch.num_layers - sum(split))
        so = replace(s, stage_layers=tuple(split))
        rc = [_fewest(so, k, m.capacity, m.gpu_bytes, load_coefficients()) for k in range(4)]
        if min(split) >= 1 and None not in rc:
            span = _sim(chunk, arch, split, rc, lead, 0.0)[-1]
            rows.append({"split": split, "recompute": rc, "busiest_work": round(max(rank_loads(so, rc)), 3),
                         "simulated_span": span})
    best = min(rows, key=lambda r: r["simulated_span"])
    chosen = next(r for r in rows if r["split"] == list(m.stage_layers))
    assert chosen["recompute"] == list(m.recompute_layers)
    for r in rows:
        r["simulated_span"] = round(r["simulated_span"] / best["simulated_span"], 4)
    return {"precision": precision, "gpu_gib": gpu_gib, "token_capacity": m.capacity,
            "chosen": {"split": list(m.stage_layers), "recompute": list(m.recompute_layers)},
            "simulator_best": {"split": best["split"], "recompute": best["recompute"]},
            "agree": best is chosen, "candidates": len(rows),
            "closest": sorted(rows, key=lambda r: r["simulated_span"])[:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split-check", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        subprocess.run([sys.executable, str(ROOT / "scripts/make_bench_data.py"), "--out", str(data),
                        "--rows", "256", "--seed", "0"], check=True, capture_output=True)
        runs = [x for x in (check_run(r, data) for r in load_runs()) if x is not None]
        for r in runs:
            if "skipped" in r:
                print(f"{r['run']}: skipped ({r['skipped']})")
                continue
            print(f"{r['run']}: measured {r['measured']}; simulated {r['simulated_no_latency']} (rms "
                  f"{r['rms_no_latency']}), with {r['best_hop_latency_ms']} ms per hand-over "
                  f"{r['simulated_best']} (rms {r['rms_best']})")
        checks = [split_check(data, p, 80.0) for p in ("bf16", "fp8")] if args.split_check else []
        for c in checks:
            print(f"split check {c['precision']} 80 GiB (capacity {c['token_capacity']}): chooser "
                  f"{c['chosen']['split']}, simulator's best of {c['candidates']} "
                  f"{c['simulator_best']['split']}: "
                  f"{'agree' if c['agree'] else 'DIFFER'}")
    rec = {**run_info(), "what": __doc__.split("\n\n")[0], "runs": runs, "split_checks": checks}
    if args.out:
        write_json(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
