"""Simulated steady bubble of a run config under 1F1B and interleaved 1F1B, over stage splits (CPU only).

The chunks are the ones the run plans (its data, its scheduler settings: `lorafusion plan`'s Feed), one per
virtual-stage count V (the plan depends on V: the dependency distance and the padding). Each microbatch's
forward time comes from the model's GEMM and attention FLOPs (one FLOP = one unit), scaled so the
simulated busy time equals the measured one; each virtual stage does its share of the model
(:mod:`lorafusion.scheduler.stages`: decoder layers, the output layer and loss on the last one). The
steady bubble is chunk 1's (chunk 0 is the warm-up chunk the measurement skips too).

Calibration against docs/results/70b-pp4-4gpu.json (V=1, even split): the per-rank bubbles simulated with the
FLOP estimate of the loss (a priori), with the loss that fits the measured per-rank bubbles best (least
squares) and with ``stages.loss_layers`` (what auto splits use), beside the measured ones; the error is
simulated - measured. The sweep uses ``stages.loss_layers``.

    python scripts/sim_interleave.py --config configs/llama3.1-70b-4adapters.yaml \\
        --measured docs/results/70b-pp4-4gpu.json --out docs/results/pipeline-interleaved-sim.json

``--gpu-memory SIZE`` (e.g. 75.99GiB, what a 4x H100 run reads as free): also, per V, the run as it would
resolve on that GPU (``lorafusion.resolve``: its token capacity, its stage split, its recompute per model
chunk, which Megatron counts per chunk: the plan's count per rank rounded up) with each recomputed layer's
cost in its virtual stage's backward (``sizing.RECOMPUTE_COST``, the fitted stage cost model's), the
chunks planned at that capacity: the simulated bubble and tokens/s (on the calibration's GPU) per V.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _bench import command, commit  # noqa: E402

from lorafusion.config.load import load_run_config  # noqa: E402
from lorafusion.core.arch import ModelArch, arch_from_hf_config, preset  # noqa: E402
from lorafusion.scheduler import CostModel, simulate_plan  # noqa: E402
from lorafusion.scheduler import stages  # noqa: E402

BACKWARD_RATIO = 2.0
P2P_S = 2.0e-4  # one 4096 x 8192 bf16 activation (64 MiB) over NVLink


def run_arch(cfg) -> ModelArch:
    if cfg.model.preset:
        return preset(cfg.model.preset)
    return arch_from_hf_config(json.loads((Path(cfg.model.path) / "config.json").read_text()))


def plan_chunks(config: str, overrides: list[str], n: int):
    from lorafusion.resolve import World, resolve
    from lorafusion.runtime.feed import Feed
    from lorafusion.runtime.jobs import load_jobs

    cfg = load_run_config(config, overrides)
    _, jobs = load_jobs(cfg)
    feed = Feed(jobs, resolve(cfg, World.for_plan(cfg), None).scheduler, dp_rank=None)
    return cfg, [c.plan for c in (feed.next() for _ in range(n)) if c is not None]


def simulate(the_plan, arch, split, loss, scale, costs=None):
    costs = costs or stages.stage_costs(split, loss, BACKWARD_RATIO)
    cm = stages.flop_cost_model(arch, loss, flops_per_s=1.0)  # one unit = one forward FLOP
    cm = CostModel(a=0.0, b=cm.b * scale, c=cm.c * scale, gamma=0.0)
    (tl,) = simulate_plan(the_plan, cm, backward_ratio=BACKWARD_RATIO, p2p_s=P2P_S, stage_costs=costs)
    return tl


def on_gpu(args, overrides: list[str], arch, loss: float, scale: float) -> list[dict]:
    """Per V: the plan ``resolve`` makes for ``--gpu-memory``, simulated with its recompute."""
    from lorafusion.resolve import GpuMemory, World, resolve
    from lorafusion.scheduler.sizing import RECOMPUTE_COST, parse_bytes
    from lorafusion.scheduler.stages import recompute_stage_costs

    gpu, rows = parse_bytes(args.gpu_memory), []
    for V in [int(v) for v in args.virtual.split(",")]:
        ov = overrides + [f"parallelism.virtual_stages={V}"]
        cfg = load_run_config(args.config, ov)
        p = resolve(cfg, World.for_plan(cfg), GpuMemory(gpu, gpu))
        split, S = list(p.stage_layers), p.pp
        per_chunk = [0 if not on else max(split) if n is None else n for on, n in p.recompute]
        the_plan = plan_chunks(args.config, ov + [f"scheduler.token_capacity={p.token_capacity}"], 2)[1][1]
        costs = recompute_stage_costs(split, loss, S, per_chunk, BACKWARD_RATIO)
        tl = simulate(the_plan, arch, split, loss, scale, costs)
        rc_rank = [sum(min(per_chunk[k], split[c * S + k]) for c in range(V)) for k in range(S)]
        loads = [round(x + RECOMPUTE_COST * r, 2) for x, r in zip(stages.rank_loads(split, S, loss), rc_rank,
                                                                   strict=True)]
        tps = sum(mb.num_tokens for mb in the_plan.microbatches) / tl.makespan
        rows.append({"virtual_stages": V, "fits": p.fits, "token_capacity": p.token_capacity,
                     "stage_layers": split, "recompute_per_rank_planned": list(p.recompute_layers),
                     "recompute_per_chunk": per_chunk, "recompute_per_rank_run": rc_rank,
                     "rank_load_layers": loads, "simulated_bubble": round(tl.bubble_ratio, 4),
                     "simulated_bubble_per_stage": [round(x, 4) for x in tl.stage_bubbles],
                     "simulated_tokens_per_s": round(tps, 1)})
        print(f"GPU {args.gpu_memory} V={V}: capacity {p.token_capacity}, split {split}, recompute per "
              f"chunk {per_chunk} (per rank {rc_rank}), rank loads {loads}: bubble {tl.bubble_ratio:.4f} "
              f"(per stage {' '.join(f'{x:.3f}' for x in tl.stage_bubbles)}), {tps:,.0f} tokens/s"
              f"{'' if p.fits else ' (does NOT fit)'}")
    return rows


def splits_for(arch: ModelArch, S: int, V: int, loss: float) -> dict[str, list[int]]:
    out = {}
    if arch.num_layers % (S * V) == 0:
        out["even"] = stages.even_split(arch.num_layers, S, V)
    if (arch.num_layers + 1) % (S * V) == 0:  # Megatron's account_for_loss_in_pipeline_split: loss = 1 layer
        per = (arch.num_layers + 1) // (S * V)
        out["megatron_account_for_loss"] = [per] * (S * V - 1) + [per - 1]
    out["auto"] = stages.auto_split(arch.num_layers, S, V, loss)
    return out


def _calibrated_run(the_plan, arch, measured: dict, loss: float):
    S = the_plan.pipeline_depth
    even = stages.even_split(arch.num_layers, S)
    busy_measured = sum(1 - b for b in measured["bubble_ratio_per_rank"]) * measured["timed_s"]
    scale = busy_measured / sum(simulate(the_plan, arch, even, loss, 1.0).busy)
    tl = simulate(the_plan, arch, even, loss, scale)
    err = [s - m for s, m in zip(tl.stage_bubbles, measured["bubble_ratio_per_rank"], strict=True)]
    return tl, scale, err


def calibrate(the_plan, arch, measured: dict) -> dict:
    """V=1, even split, scaled to the measured busy time: per-rank bubbles with the a-priori (FLOP) loss, the
    loss of least squares over the per-rank bubbles (grid 0.5..5 layers), and ``stages.loss_layers``."""
    grid = [0.5 + 0.05 * k for k in range(91)]
    fitted = min(grid, key=lambda x: sum(e * e for e in _calibrated_run(the_plan, arch, measured, x)[2]))
    out = {}
    for name, loss in (("flops", stages.flop_loss_layers(arch)), ("least_squares", fitted),
                       ("used", stages.loss_layers(arch))):
        tl, scale, err = _calibrated_run(the_plan, arch, measured, loss)
        out[name] = {"loss_layers": round(loss, 3), "simulated_bubble": round(tl.bubble_ratio, 4),
                     "simulated_bubble_per_stage": [round(x, 4) for x in tl.stage_bubbles],
                     "error": round(tl.bubble_ratio - measured["bubble_ratio"], 4),
                     "error_per_stage": [round(e, 4) for e in err],
                     "rms_error_per_stage": round((sum(e * e for e in err) / len(err)) ** 0.5, 4),
                     "simulated_s": round(tl.makespan, 2), "measured_s": measured["timed_s"],
                     "sim_flops_per_s": round(1.0 / scale, -10)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/llama3.1-70b-4adapters.yaml")
    ap.add_argument("--measured", default="docs/results/70b-pp4-4gpu.json")
    ap.add_argument("--virtual", default="1,2,4,5", help="virtual-stage counts to try")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu-memory", default=None, help="also each V as resolved on a GPU of this free memory")
    ap.add_argument("overrides", nargs="*", default=["parallelism.dp=1"])
    args = ap.parse_args()
    measured = json.loads(Path(args.measured).read_text())
    overrides = list(args.overrides) + list(measured.get("overrides", []))
    if "model.recompute=false" in overrides:  # (the config's recompute_layers: auto needs recompute)
        overrides.append("model.recompute_layers=null")
    cfg, plans = plan_chunks(args.config, overrides, 2)
    arch = run_arch(cfg)
    S = cfg.parallelism.pp
    cal = calibrate(plans[1], arch, measured)
    loss, scale = stages.loss_layers(arch), 1.0 / cal["used"]["sim_flops_per_s"]
    rows = []
    for V in [int(v) for v in args.virtual.split(",")]:
        vplans = (plans if V == 1
                  else plan_chunks(args.config, overrides + [f"parallelism.virtual_stages={V}"], 2)[1])
        for name, split in splits_for(arch, S, V, loss).items():
            tl = simulate(vplans[1], arch, split, loss, scale)
            rows.append({"virtual_stages": V, "split_name": name, "stage_layers": split,
                         "rank_load_layers": [round(x, 2) for x in stages.rank_loads(split, S, loss)],
                         "simulated_bubble": round(tl.bubble_ratio, 4),
                         "simulated_bubble_per_stage": [round(x, 4) for x in tl.stage_bubbles],
                         "noops": vplans[1].num_noops, "microbatches_per_rank": vplans[1].num_slots,
                         "simulated_s": round(tl.makespan, 2),
                         "simulated_tokens_per_s": round(sum(mb.num_tokens for mb in vplans[1].microbatches)
                                                         / tl.makespan, 1)})
            print(f"V={V} {name:<26} bubble {tl.bubble_ratio:.4f}  per stage "
                  f"{' '.join(f'{x:.3f}' for x in tl.stage_bubbles)}  noops {vplans[1].num_noops}")
    best = min(rows, key=lambda r: r["simulated_bubble"])
    v1 = next(r for r in rows if r["virtual_stages"] == 1 and r["split_name"] == "even")
    res = {"config": args.config, "overrides": overrides, "date": datetime.date.today().isoformat(),
           "commit": commit(), "command": command(),
           "model": {"num_layers": arch.num_layers,
                     "loss_layers_flops": round(stages.flop_loss_layers(arch), 3),
                     "loss_layers_calibrated": round(loss, 3)},
           "simulator": {"backward_ratio": BACKWARD_RATIO, "p2p_s": P2P_S, "chunk": 1,
                         "cost": "GEMM + causal attention FLOPs per microbatch, scaled to the measured busy "
                                 "time"},
           "measured": {"source": args.measured, "device": measured.get("device"),
                        "bubble_ratio": measured["bubble_ratio"],
                        "bubble_ratio_per_stage": measured["bubble_ratio_per_rank"]},
           "calibration_v1_even": cal, "v1_even": v1, "best": best, "target": 0.05,
           "met": best["simulated_bubble"] <= 0.05, "runs": rows}
    print(f"measured V=1 even {measured['bubble_ratio']:.4f}; simulated {v1['simulated_bubble']:.4f} "
          f"(calibration error {cal['used']['error']:+.4f}, per stage rms "
          f"{cal['used']['rms_error_per_stage']:.4f}; a priori FLOP loss {cal['flops']['error']:+.4f}; "
          f"least-squares loss {cal['least_squares']['loss_layers']} layers); "
          f"best V={best['virtual_stages']} {best['split_name']} {best['stage_layers']}: "
          f"{best['simulated_bubble']:.4f}")
    if args.gpu_memory:
        runs = on_gpu(args, list(args.overrides), arch, loss, scale)
        res["gpu_plan"] = {"gpu_memory": args.gpu_memory, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
