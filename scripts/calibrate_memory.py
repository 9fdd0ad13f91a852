"""Measure peak GPU memory of LoRA training over a grid, and fit / check the memory model against it.

    python scripts/calibrate_memory.py measure --out raw.json [--budget-s 330]      # on a GPU
    python scripts/calibrate_memory.py fit raw.json --json docs/results/memory-model.json \
        [--write-coefficients]                                                          # anywhere, no torch

``measure`` builds each shape once (the llama3.1-8b preset, and a llama3.1-70b-width decoder of a few layers
that stands for one pipeline stage: the 70B's hidden, heads and FFN, its embedding and output layer), puts
adapter sets on it (4 and 12 adapters at ranks 16 and 64, all-linear, dropout 0.1), and for each recompute
setting (none, the first half of the layers, every layer) and token capacity (2k-16k) runs what the runtime
runs for one microbatch: a packed microbatch of ``capacity`` tokens (samples of mixed length, contiguous per
adapter, every adapter present) through the model with the fused ops and kernels, backward, and each
adapter's optimizer step (clip + AdamW). ``in_flight`` k > 1 runs k forwards before the k backwards: stage 0
of a k-stage 1F1B pipeline at its peak. Each point records ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` after a reset, the allocated memory before it (weights + adapters + AdamW states),
or ``oom`` when it did not fit, and the attention path it ran on (``attention``: the memory model counts
what each saves; grids from before the field are labelled by :func:`label_attention`), and
``rebuilt_inputs`` (the layers rebuild the normed and SwiGLU inputs of their LoRA linears in backward; points
without the field were measured while those were kept, and are predicted so). Points are written
as they come (a cut-off run keeps what it measured).

``fit`` fits :class:`lorafusion.scheduler.memory.Coefficients` (activation scale, backward workspace,
constant) on the fit subset by least squares and reports the prediction error on every held-out point.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _bench import run_info  # noqa: E402

CAPACITIES = (2048, 4096, 8192, 12288, 16384)
ADAPTER_SETS = ((4, 16), (12, 16), (4, 64), (12, 64))  # (count, rank)
GRADS_AT_PEAK = True
# LoRASpec's default layout (PEFT's: an A per fused projection); the H100 raw points predate it
INDEPENDENT_A = True
LENGTHS = (3072, 512, 1536, 256, 2048, 1024, 768)  # sample lengths cycled to fill a microbatch (max 4096)


def _samples(capacity: int, adapters: list[str]) -> list[tuple[str, int]]:
    """(adapter, length) filling exactly ``capacity`` tokens, every adapter present, contiguous per
    adapter."""
    lens, left, i = [], capacity, 0
    while left > 0:
        n = min(LENGTHS[i % len(LENGTHS)], left)
        lens.append(n)
        left -= n
        i += 1
    while len(lens) < len(adapters):  # split the longest until every adapter gets a sample
        k = max(range(len(lens)), key=lens.__getitem__)
        lens[k:k + 1] = [lens[k] // 2, lens[k] - lens[k] // 2]
    # consecutive runs of samples, one per adapter, sizes differing by at most one (the ceil-sized runs this
    # replaced left an adapter without a sample, hence without gradients, e.g. 4 adapters at 8,192 tokens)
    return [(adapters[j * len(adapters) // len(lens)], n) for j, n in enumerate(lens)]


def _batch(capacity: int, adapters: list[str], vocab: int, seed: int):
    import torch

    from lorafusion.data.packing import pack_microbatch

    g = torch.Generator().manual_seed(seed)
    samples = [(a, torch.randint(1, vocab, (n,), generator=g).tolist())
               for a, n in _samples(capacity, adapters)]
    return pack_microbatch(samples, prompt_lengths=[len(s) // 4 for _, s in samples])


def _set_recompute(model, mode: str, layers: int) -> int:
    """Recompute none / the first half of the layers (Megatron's block method) / every layer: the model
    config's fields are read at each forward. Returns the recomputed layer count."""
    c = model.config
    if mode == "none":
        c.recompute_granularity, c.recompute_method, c.recompute_num_layers = None, None, None
        return 0
    n = layers if mode == "full" else layers // 2
    c.recompute_granularity = "full"
    c.recompute_method, c.recompute_num_layers = ("uniform", 1) if mode == "full" else ("block", n)
    return n


def _step(model, optimizers, batches, dev) -> None:
    """k forwards (each kept for backward, like 1F1B's warm-up), k backwards, every adapter's step."""
    from lorafusion.layers import set_batch

    losses = []
    for b in batches:
        b = b.to(dev)
        set_batch(model, b.routing, b.adapters, [7] * len(b.adapters))
        per_token = model(b.tokens, b.position_ids, attention_mask=None, labels=b.labels,
                          packed_seq_params=b.packed_seq_params())
        losses.append((per_token.float().reshape(-1) * b.loss_mask.reshape(-1)).sum() / b.num_tokens)
    for loss in losses:
        loss.backward()
    del losses
    for opt in optimizers.values():
        opt.begin_step()
        opt.end_step()
    set_batch(model, None, ())


def _measure_point(model, optimizers, arch, point: dict, dev) -> dict:
    import torch

    adapters = list(optimizers)
    batches = [_batch(point["capacity"], adapters, arch.vocab_size, seed=s)
               for s in range(point["in_flight"])]
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        _step(model, optimizers, batches, dev)
        torch.cuda.synchronize()
        out = {"peak_allocated": torch.cuda.max_memory_allocated(),
               "peak_reserved": torch.cuda.max_memory_reserved()}
    except torch.OutOfMemoryError:
        out = {"oom": True, "peak_allocated": torch.cuda.max_memory_allocated()}
    for p in model.parameters():
        p.grad = None
    out.update(before=before, seconds=round(time.perf_counter() - t0, 3))
    return out


def _attach(model, count: int, rank: int) -> dict:
    from lorafusion.core.lora import LoRASpec
    from lorafusion.layers import adapter_parameters, add_adapter, get_lora_context, remove_adapter
    from lorafusion.runtime.optim import AdapterOptimizer

    for name in list(get_lora_context(model).specs):
        remove_adapter(model, name)
    opts = {}
    for i in range(count):
        name = f"a{i}"
        add_adapter(model, name,
                    LoRASpec(r=rank, lora_alpha=2 * rank, lora_dropout=0.1, target_modules="all-linear",
                             shared_fused_a=not INDEPENDENT_A), seed=i)
        opts[name] = AdapterOptimizer(list(adapter_parameters(model, name).values()), lr=1e-4,
                                      weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, schedule="constant",
                                      warmup_steps=0, total_steps=100, min_lr_ratio=0.0, max_grad_norm=1.0)
    return opts


def _grid(shape: str, layers: int, extra: tuple[int, ...] = ()) -> list[dict]:
    """The grid of one shape; ``extra`` capacities (a larger GPU's) are added for the 8B shape."""
    rc = ("none", "half", "full")
    caps = CAPACITIES + (tuple(extra) if shape == "8b" else ())
    pts = [dict(adapters=c, rank=r, recompute=m, capacity=cap, in_flight=1)
           for c, r in ADAPTER_SETS for m in rc for cap in caps]
    if shape == "8b":  # 1F1B stage 0 of a 2- and 3-stage pipeline: k microbatches in flight
        pts += [dict(adapters=4, rank=16, recompute=m, capacity=cap, in_flight=k)
                for m, cap, k in (("none", 4096, 2), ("none", 8192, 2), ("half", 8192, 2), ("full", 8192, 2),
                                  ("none", 4096, 3), ("full", 16384, 3))]
    return pts


def measure(args) -> None:
    from lorafusion.core.procenv import set_process_env

    set_process_env()  # the allocator and OpenMP settings `lorafusion train` runs with
    import torch

    from lorafusion.core.arch import preset
    from lorafusion.dist import init_distributed
    from lorafusion.models.attention import attention_path
    from lorafusion.models.provider import build_model

    t_start = time.perf_counter()
    init_distributed(1, 1, seed=1)
    dev = torch.device("cuda", torch.cuda.current_device())
    raw = {**run_info(), "gpu_total_bytes": torch.cuda.mem_get_info()[1],
           "torch": torch.__version__, "points": []}
    shapes = [("8b", preset("llama3.1-8b")),
              ("70b-width", preset("llama3.1-70b", num_layers=args.layers_70b))]
    shapes = [(name, arch) for name, arch in shapes if name in args.shapes.split(",")]
    for k, (shape, arch) in enumerate(shapes):
        t0 = time.perf_counter()
        # the time left, shared by the shapes
        deadline = t0 + (args.budget_s - (t0 - t_start)) / (len(shapes) - k)
        model = build_model(arch, params_dtype=torch.bfloat16, recompute=True, device=dev, seed=1)
        model.train()
        build_s = time.perf_counter() - t0
        pts = _grid(shape, arch.num_layers, args.extra_capacities)
        current = None
        for p in sorted(pts, key=lambda p: (p["adapters"] * p["rank"], p["adapters"], p["rank"])):
            if time.perf_counter() > deadline:
                print(f"budget of {args.budget_s} s reached: {shape} stops", flush=True)
                break
            if current != (p["adapters"], p["rank"]):
                optimizers = _attach(model, p["adapters"], p["rank"])
                current = (p["adapters"], p["rank"])
                _set_recompute(model, "full", arch.num_layers)  # the first step creates the AdamW moments
                _measure_point(model, optimizers, arch, dict(capacity=2048, in_flight=1), dev)
            n = _set_recompute(model, p["recompute"], arch.num_layers)
            rec = dict(shape=shape, num_layers=arch.num_layers, recompute_layers=n,
                       independent_a=INDEPENDENT_A, rebuilt_inputs=True, **p,
                       **_measure_point(model, optimizers, arch, p, dev))
            rec["attention"] = attention_path()  # after the point: a fallback during it counts
            raw["points"].append(rec)
            print(json.dumps(rec), flush=True)
            Path(args.out).write_text(json.dumps(raw, indent=1) + "\n")
        raw.setdefault("build_s", {})[shape] = round(build_s, 1)
        del model, optimizers
        gc.collect()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(raw, indent=1) + "\n")


def label_attention(raw: dict) -> None:
    """Give each point of a raw grid the attention path it ran on (``attention``: "per-sample" or the varlen
    op, :data:`lorafusion.scheduler.memory.ATTENTION_DEFAULT`). Grids measured before the field existed ran in
    one process in file order, and until models/attention.py re-raised out-of-memory errors (2026-11-25) it
    switched to its per-sample SDPA fallback for good when ``varlen_attn`` raised any RuntimeError, out of
    memory included: so every point after the first out-of-memory one ran per-sample (on the H100 grid they
    peak exactly one q-width bf16 tensor per token per kept layer above the H200 grid's same points, which had
    no out-of-memory point). The out-of-memory point itself is labelled by the path it started on."""
    from lorafusion.scheduler.memory import ATTENTION_DEFAULT

    fell_back = False
    for p in raw["points"]:
        p.setdefault("attention", "per-sample" if fell_back else ATTENTION_DEFAULT)
        fell_back = fell_back or bool(p.get("oom"))


def _setup(pt: dict):
    from lorafusion.core.arch import preset
    from lorafusion.scheduler.memory import ATTENTION_DEFAULT, AdapterShape, MemorySetup

    base = "llama3.1-8b" if pt["shape"] == "8b" else "llama3.1-70b"
    arch = preset(base, num_layers=pt["num_layers"])
    a = AdapterShape(pt["rank"], dropout=0.1, independent_a=pt.get("independent_a", False))
    # points without the field were measured while the normed and SwiGLU inputs were kept
    return MemorySetup(arch, tuple(a for _ in range(pt["adapters"])),
                       attention=pt.get("attention", ATTENTION_DEFAULT),
                       rebuilt_inputs=pt.get("rebuilt_inputs", False))


def predict(pt: dict, coeffs) -> float:
    from lorafusion.scheduler.memory import stage_memory

    return stage_memory(_setup(pt), 0, pt["capacity"], pt["recompute_layers"], coeffs,
                        n_in_flight=pt["in_flight"], grads_before_backward=GRADS_AT_PEAK).peak


def in_fit(pt: dict, subset: str) -> bool:
    """The points the coefficients are fitted on; every other point is held out."""
    base = pt["in_flight"] == 1 and pt["capacity"] in (2048, 8192, 16384)
    return base and (subset == "both" or pt["shape"] == "8b")


def fit(points: list[dict], subset: str):
    """Least squares on relative error: a grid over (act_scale, workspace, opt_copies), then a finer one
    around the best; the constant in closed form."""
    import itertools

    import numpy as np

    from lorafusion.scheduler.memory import Coefficients

    pts = [p for p in points if in_fit(p, subset)]
    y = np.array([p["peak_allocated"] for p in pts], dtype=float)

    def score(act, ws, opt):
        c = Coefficients(act_scale=float(act), workspace=float(ws), constant_bytes=0.0, opt_copies=float(opt))
        pred = np.array([predict(p, c) for p in pts])
        const = float(np.sum((y - pred) / y**2) / np.sum(1 / y**2))  # relative-error optimum
        return float(np.sum(((pred + const - y) / y) ** 2)), const

    best, steps = (1.0, 1.0, 5.0), (0.04, 0.4, 2.0)
    for _ in range(4):  # coarse to fine: 5 values per axis around the best, steps halved each round
        axes = [[b + k * st for k in (-2, -1, 0, 1, 2)] for b, st in zip(best, steps)]
        cand = [c for c in itertools.product(*axes) if c[0] > 0 and c[1] >= 0 and c[2] >= 0]
        best = min(cand, key=lambda c: score(*c)[0])
        steps = tuple(st / 2 for st in steps)
    act, ws, opt = best
    return Coefficients(act_scale=round(act, 4), workspace=round(ws, 3), opt_copies=round(opt, 2),
                        constant_bytes=round(score(*best)[1]))


def fit_main(args) -> None:
    from dataclasses import asdict, replace

    from lorafusion.scheduler.memory import COEFFICIENTS_FILE, GIB, load_coefficients

    raws = [json.loads(Path(p).read_text()) for p in args.raw]
    for r in raws:
        label_attention(r)
    points = [p for r in raws for p in r["points"] if not p.get("oom")]
    check = args.coefficients is not None  # predict with committed coefficients: every point is held out
    coeffs = load_coefficients(args.coefficients) if check else fit(points, args.subset)
    held_out = (lambda p: True) if check else (lambda p: not in_fit(p, args.subset))
    rows = []
    for p in [p for r in raws for p in r["points"]]:
        pred = predict(p, coeffs)
        row = {k: p[k] for k in ("shape", "num_layers", "adapters", "rank", "recompute", "recompute_layers",
                                 "capacity", "in_flight", "attention")}
        row.update(predicted_gib=round(pred / GIB, 3), held_out=held_out(p))
        if p.get("oom"):
            row.update(oom=True, predicted_fits=pred * (1 + coeffs.margin_frac) < raws[0]["gpu_total_bytes"])
        else:
            row.update(measured_gib=round(p["peak_allocated"] / GIB, 3),
                       reserved_gib=round(p["peak_reserved"] / GIB, 3),
                       error_pct=round(100 * (pred - p["peak_allocated"]) / p["peak_allocated"], 2))
        rows.append(row)
    ok = [r for r in rows if "error_pct" in r]
    # what a plan keeps free over the prediction: 3% of it (the model's error) and the most the allocator's
    # reserved memory exceeded 1.03 x the prediction on any point (cached blocks, fragmentation), at least
    # 1 GiB
    over = max((r["reserved_gib"] - 1.03 * r["predicted_gib"] for r in ok), default=0.0)
    if not check:
        coeffs = replace(coeffs, margin_frac=0.03, margin_bytes=max(1.0, math.ceil(over * 10) / 10) * GIB,
                         source=f"scripts/calibrate_memory.py on {raws[0]['device']} at {raws[0]['commit']} "
                                f"(fit on {args.subset}: 2k/8k/16k, one microbatch; "
                                "docs/results/memory-model.json)")
    held = [abs(r["error_pct"]) for r in ok if r["held_out"]]
    summary = {"device": raws[0]["device"], "commit": raws[0]["commit"], "command": raws[0]["command"],
               "torch": raws[0]["torch"], "coefficients": asdict(coeffs),
               "fit_subset": "none (committed coefficients, every point held out)" if check else args.subset,
               "max_abs_error_pct_held_out": max(held, default=None), "held_out_points": len(held),
               "within_7pct": sum(e <= 7 for e in held), "reserved_over_1.03_prediction_gib": round(over, 2),
               "points": rows}
    for r in rows:
        print(f"{r['shape']:>9} L{r['num_layers']:<2} {r['adapters']:>2}x r{r['rank']:<2} "
              f"{r['recompute']:>4} C{r['capacity']:>5} k{r['in_flight']} pred {r['predicted_gib']:6.1f} "
              f"meas {r.get('measured_gib', float('nan')):6.1f} err {r.get('error_pct', float('nan')):6.2f}% "
              f"{'held-out' if r['held_out'] else 'fit'}{' OOM' if r.get('oom') else ''}")
    print(json.dumps({k: v for k, v in summary.items() if k != "points"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.write_coefficients:
        COEFFICIENTS_FILE.write_text(json.dumps(asdict(coeffs), indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--budget-s", type=float, default=330.0,
                   help="stop starting points after this many seconds")
    m.add_argument("--layers-70b", type=int, default=10)
    m.add_argument("--shapes", default="8b,70b-width", help="which shapes to measure (comma-separated)")
    m.add_argument("--extra-capacities", type=lambda v: tuple(int(x) for x in v.split(",") if x), default=(),
                   help="capacities added to the 8B shape's grid, e.g. 20480,24576 on a 141 GB GPU")
    f = sub.add_parser("fit")
    f.add_argument("raw", nargs="+")
    f.add_argument("--json", help="write grid, predicted, measured, error here")
    f.add_argument("--subset", choices=("8b", "both"), default="8b", help="fit on the 8B shape's points only "
                   "(the 70B-width shape all held out) or on both shapes'")
    f.add_argument("--coefficients", help="check these coefficients (a memory_coefficients.json) instead of "
                   "fitting: every point is held out")
    f.add_argument("--write-coefficients", action="store_true",
                   help="rewrite lorafusion/scheduler/memory_coefficients.json with the fit")
    args = ap.parse_args()
    if args.cmd == "measure":
        measure(args)
    else:
        fit_main(args)


if __name__ == "__main__":
    main()
