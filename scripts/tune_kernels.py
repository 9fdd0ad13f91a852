#!/usr/bin/env python
"""Choose block configs per kernel and shape bucket on this GPU; write them as JSON.

Times each candidate with triton.testing.do_bench (median, CUDA events) on the five benchmark shapes
(r=16, p=0.1, bf16) and the multi-adapter case (r_max=64), or on ``--shapes`` (m,k,n of a model's linears,
optionally ``@r1,r2,...``: the per-call rank of each adapter segment, e.g. 48 for an r=16 adapter on the
fused q/k/v linear) with ``--segments`` equal segments, and keeps the fastest per (kernel, bucket). The first
candidate timed is always the config the kernels use today at that bucket ("before"). A candidate whose
output differs from that config's (beyond bf16 rounding of the fp32 accumulation order) is rejected.
Paste the result into ``lorafusion/kernels/tuning.py`` (the table of the GPU's architecture), or point
LORAFUSION_TUNING_FILE at the JSON. ``--summary`` writes, per case and kernel, the summed time over the
case's linears before and after.

    python scripts/tune_kernels.py --out tuned.json
    python scripts/tune_kernels.py --shapes 32768,4096,6144@48,48,48,48 32768,14336,4096 --segments 4 \
        --kernels lowrank,shrink,ds_db,da_dx --out tuned.json      # the 8B's linears, 4 adapters
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lorafusion.ops.tables import TableCache  # noqa: E402
from lorafusion.kernels import fused_multi_lora as K  # noqa: E402
from lorafusion.kernels import tuning  # noqa: E402
from lorafusion.core.routing import Routing  # noqa: E402

SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 4096, 4096),
          (4096, 8192, 8192)]

# Hopper-sized candidates (a few per kernel: every new config is a compile). The config the kernels use today
# at a bucket is always timed first, whether or not it is listed here.
CANDIDATES = {
    "gemm": [dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4),
                                      (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]],
    "lowrank": [dict(BM=bm, BN=bn, GROUP_M=8, num_warps=w, num_stages=1)
                for bm, bn, w in [(128, 128, 8), (64, 256, 4), (128, 256, 8)]],
    "shrink": [dict(BM=bm, BK=bk, num_warps=w, num_stages=s)
               for bm, bk, w, s in [(64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 8, 4)]],
    "ds_db": [dict(BM=bm, BN=bn, CH=ch, num_warps=w, num_stages=s)
              for bm, bn, ch, w, s in [(64, 256, 1024, 8, 3), (128, 256, 1024, 8, 3), (32, 512, 1024, 8, 3),
                                       (64, 256, 2048, 8, 4)]],
    "da_dx": [dict(BM=bm, BK=bk, CH=ch, num_warps=w, num_stages=s)
              for bm, bk, ch, w, s in [(64, 128, 1024, 4, 3), (64, 128, 1024, 8, 4), (128, 128, 1024, 8, 3),
                                       (64, 64, 512, 4, 4), (128, 64, 2048, 8, 4)]],
    "da": [dict(BM=bm, BK=bk, CH=ch, num_warps=w, num_stages=s)
           for bm, bk, ch, w, s in [(64, 128, 1024, 4, 3), (64, 256, 1024, 8, 3), (128, 128, 1024, 8, 3),
                                    (64, 128, 512, 4, 4), (64, 128, 2048, 4, 3), (32, 256, 512, 4, 5)]],
}

WARMUP_MS, REP_MS = 10, 40


def timeit(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _parts(out) -> list[torch.Tensor]:
    """A launcher's result (tensor, or (tensor, [per-slot tensors])) as a list of fp32 tensors."""
    parts = [out] if isinstance(out, torch.Tensor) else [out[0], *(t for t in out[1] if t is not None)]
    return [t.float() for t in parts]


def differs(got: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    """Any part more than bf16 rounding apart (tile shapes only change the fp32 summation order)."""
    return len(got) != len(ref) or any(
        g.shape != r.shape or bool(((g - r).abs() > 2e-2 * r.abs() + 2e-2 * r.abs().max()).any())
        for g, r in zip(got, ref))


def _wall_ms(fn):
    import time

    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _set(kernel, bucket, cfg):
    """Use ``cfg`` at (kernel, bucket) from now on (None: back to what the kernels use without it)."""
    table = tuning.tuned_table()
    if cfg is None:
        table.pop((kernel, bucket), None)
    else:
        table[(kernel, bucket)] = cfg
    K._CONFIGS.clear()  # the launchers memoize configs: forget them, or every candidate runs the first one


def tune_one(kernel, bucket, run):
    """(best (config, ms), the current config's ms, every row); the current config is timed first."""
    current = tuning.get_config(kernel, *bucket)
    best, rows = None, []
    ref = _parts(run(True))  # the current config's output (run(True): on fresh copies of in-place operands)
    for i, cfg in enumerate([current] + [c for c in CANDIDATES[kernel] if c != current]):
        _set(kernel, bucket, cfg)
        try:
            if i and differs(_parts(run(True)), ref):
                rows.append((cfg, None, "WRONG RESULT"))
                continue
            ms = timeit(run)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            rows.append((cfg, None, type(e).__name__))
            continue
        rows.append((cfg, ms, ""))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    _set(kernel, bucket, best[0] if best else None)  # later cases run with what was chosen here
    return best, rows[0][1], rows


def _cases(args):
    """(m, k, n, per-call ranks) to tune at."""
    if not args.shapes:
        return [(m, k, n, [16]) for m, k, n in SHAPES] + [(8192, 4096, 4096, [8, 16, 32, 64])]
    cases = []
    for spec in args.shapes:
        dims, _, ranks = spec.partition("@")
        shape = tuple(int(v) for v in dims.split(","))
        if len(shape) != 3:
            raise SystemExit(f"--shapes: expected M,K,N[@r1,r2,...], got {spec!r}")
        cases.append((*shape, [int(r) for r in ranks.split(",")] if ranks else [16] * args.segments))
    return cases


def _routing(m, ranks, shapes_given):
    if len(ranks) == 1:
        return Routing.single(m)
    if shapes_given or len(set(ranks)) == 1:  # equal segments
        ls = [m // len(ranks)] * (len(ranks) - 1)
        return Routing.from_lengths(list(range(len(ranks))), ls + [m - sum(ls)])
    ls = [int(m * f) for f in (0.37, 0.29, 0.21)]
    return Routing.from_lengths([0, 1, 2, 3], ls + [m - sum(ls)])


def _summary(results) -> list[dict]:
    """Per case (m and ranks) and kernel: the time summed over the case's linears, before and after."""
    out: dict = {}
    for r in results:
        key = (r["shape"][0], r["case"], r["kernel"])
        row = out.setdefault(key, {"m": key[0], "case": key[1], "kernel": key[2], "linears": 0,
                                   "before_ms": 0.0, "after_ms": 0.0})
        row["linears"] += 1
        row["before_ms"] += r["default_ms"] or 0.0
        row["after_ms"] += r["ms"]
    for row in out.values():
        row["speedup"] = round(row["before_ms"] / row["after_ms"], 3) if row["after_ms"] else None
    return list(out.values())


def _jobs(m, k, n, ranks, dev, dt, p, lowrank_dx):
    """kernel -> [((m, n, k) of its bucket, run(check=False))] on random operands of this case."""
    torch.manual_seed(0)
    routing = _routing(m, ranks, not lowrank_dx)
    # one table cache per case, as the layers keep one per microbatch: the routing tables of a block size
    # are built on a config's first call and reused, so the timing is the kernel's, not host-side table
    # building (a fresh cache per call made configs with more row chunks look slower)
    tc = TableCache()
    st = TableCache().slot_tables(ranks, [2.0] * len(ranks), [p] * len(ranks), list(range(len(ranks))), dev)
    ids = TableCache().row_ids(routing, dev)
    rt = sum(ranks)
    x = torch.randn(m, k, device=dev, dtype=dt)
    W = (torch.randn(n, k, device=dev) / k**0.5).to(dt)
    A = (torch.randn(rt, k, device=dev) / k**0.5).to(dt)
    B = (torch.randn(n, rt, device=dev) * 0.1).to(dt)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    S = K.lora_shrink(x, A, st, routing, ids, k_total=k, cache=tc)
    dS, _ = K.lora_ds_db(dy, B, S, st, routing, cache=tc)
    # dY·W, what the da_dx pass adds into (in place: timed runs use dxb, checks a copy of dx0)
    dx0 = dy @ W
    dxb = dx0.clone()
    drop = p > 0
    return {
        "gemm": [((m, n, k), lambda check=False: K.lora_gemm(x, W.t(), None, S, B.t(), st.scale, st, routing,
                                                             n=n, cache=tc)),
                 ((m, k, n), lambda check=False: K.lora_gemm(dy, W, None, dS, A, st.inv_keep, st, routing,
                                                             n=k, dropout=drop, row_ids=ids, k_total=k,
                                                             cache=tc))],
        "lowrank": [((m, n, 0), lambda check=False: K.lora_gemm(None, None, None, S, B.t(), st.scale, st,
                                                                routing, n=n, cache=tc)),
                    ((m, k, 0), lambda check=False: K.lora_gemm(None, None, None, dS, A, st.inv_keep, st,
                                                                routing, n=k, dropout=drop, row_ids=ids,
                                                                k_total=k, cache=tc))]
                   [: 2 if lowrank_dx else 1],  # the dX variant (main_gemm "triton" only) would share a
                                                # bucket with the forward of an n == k linear
        "shrink": [((m, st.r_max, k), lambda check=False: K.lora_shrink(x, A, st, routing, ids, k_total=k,
                                                                        cache=tc))],
        "ds_db": [((m, n, st.r_max), lambda check=False: K.lora_ds_db(dy, B, S, st, routing, cache=tc))],
        "da": [((m, st.r_max, k),
                lambda check=False: K.lora_da(x, dS, st, routing, ids, k_total=k, cache=tc))],
        "da_dx": [((m, st.r_max, k),
                   lambda check=False: K.lora_da_dx(x, dS, A, dx0.clone() if check else dxb, st, routing, ids,
                                                    k_total=k, cache=tc))],
    }


def _mask_cost(m, k, n, ranks, dev, dt, kernels) -> dict:
    """The masked kernels (shrink, da_dx) at their chosen configs without dropout: what the mask costs."""
    jobs = _jobs(m, k, n, ranks, dev, dt, 0.0, False)
    return {kern: timeit(jobs[kern][0][1]) for kern in ("shrink", "da_dx") if kern in kernels}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tuned.json")
    ap.add_argument("--summary", help="also write the before/after sums per case and kernel here")
    ap.add_argument("--kernels", default="gemm,lowrank,shrink,ds_db,da,da_dx")
    ap.add_argument("--shapes", nargs="+", metavar="M,K,N[@R,...]", help="linears to tune at (default: the "
                    "five benchmark shapes and the r 8/16/32/64 multi-adapter case)")
    ap.add_argument("--segments", type=int, default=1, help="with --shapes: equal segments of r=16 adapters")
    ap.add_argument("--mask-cost", action="store_true",
                    help="also time shrink and da_dx without dropout (cases of equal ranks)")
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench's timing window per candidate")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a dry run under TRITON_INTERPRET=1 (fp32, wall clock)")
    args = ap.parse_args()
    global timeit, REP_MS, WARMUP_MS
    REP_MS, WARMUP_MS = args.rep_ms, max(2, args.rep_ms // 4)
    kernels = args.kernels.split(",")
    dev, dt = args.device, (torch.bfloat16 if args.device != "cpu" else torch.float32)
    if dev == "cpu":
        timeit = _wall_ms
    os.environ.pop("LORAFUSION_TUNING_FILE", None)
    results, done, masks = [], set(), []
    for m, k, n, ranks in _cases(args):
        jobs = _jobs(m, k, n, ranks, dev, dt, 0.1, not args.shapes)
        label = f"{'mixed' if len(set(ranks)) > 1 else 'uniform'} x{len(ranks)}"
        for kernel in kernels:
            for shape, run in jobs[kernel]:
                bucket = tuning.bucket(*shape)
                if (kernel, bucket) in done:
                    continue
                done.add((kernel, bucket))
                best, before_ms, rows = tune_one(kernel, bucket, run)
                if best is None:
                    continue
                results.append({"kernel": kernel, "bucket": list(bucket), "config": best[0], "ms": best[1],
                                "default_ms": before_ms, "shape": [m, k, n], "ranks": ranks, "case": label})
                print(f"{kernel:8s} {str(bucket):22s} best {best[1]:.4f} ms (before {before_ms}) {best[0]}",
                      flush=True)
                for cfg, ms, err in rows:
                    print(f"      {ms if ms is None else round(ms, 4)!s:>8} {err} {cfg}")
                _write(args, results, masks)  # after every bucket: a run cut short keeps what it chose
        if args.mask_cost and len(set(ranks)) == 1:
            masks.append({"shape": [m, k, n], "ranks": ranks, "no_dropout_ms": _mask_cost(m, k, n, ranks, dev,
                                                                                           dt, kernels)})
            print(f"no dropout {m},{k},{n}: {masks[-1]['no_dropout_ms']}", flush=True)
    _write(args, results, masks)
    print(f"wrote {len(results)} configs to {args.out}")


def _write(args, results, masks):
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "by_case": _summary(results), "mask_cost": masks, "tuned": results}, f, indent=1)


if __name__ == "__main__":
    main()
