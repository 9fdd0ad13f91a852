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
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lorafusion.ops.tables import TableCache  # noqa: E402
from lorafusion.kernels import fused_multi_lora as K  # noqa: E402
from lorafusion.kernels import tuning  # noqa: E402
from lorafusion.core.routing import Routing  # noqa: E402

SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 4096, 4096),
          (4096, 8192, 8192)]

# Hopper-sized candidates, a few per kernel (every new config and rank block is a compile, ~1 s each): the
# config the kernels use today at a bucket is always timed first, whether or not it is listed here. dS by the
# shrink pass (lora_ds_db split) runs at the shrink config of its bucket (m, rank, n), not tuned here.
CANDIDATES = {
    "gemm": [dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4),
                                      (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]],
    "lowrank": [dict(BM=bm, BN=bn, GROUP_M=8, num_warps=w, num_stages=1)
                for bm, bn, w in [(128, 128, 8), (64, 256, 4)]],
    "shrink": [dict(BM=bm, BK=bk, num_warps=w, num_stages=s)
               for bm, bk, w, s in [(64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3)]],
    "ds_db": [dict(BM=bm, BN=bn, CH=ch, num_warps=w, num_stages=s)
              for bm, bn, ch, w, s in [(64, 256, 1024, 8, 3), (128, 256, 1024, 8, 3)]]
             # dS by the shrink pass, dB alone (lora_ds_db)
             + [dict(BM=64, BN=256, CH=2048, num_warps=8, num_stages=3, SPLIT=1)],
    # on one H200 4 warps beat 8 at every rank block (two CTAs an SM at 255 registers); PREFETCH: the next row
    # block's dX and dS loaded one iteration ahead
    "da_dx": [dict(BM=bm, BK=bk, CH=ch, num_warps=4, num_stages=3, PREFETCH=p)
              for bm, bk, ch, p in [(64, 128, 1024, 0), (32, 128, 1024, 1), (64, 128, 1024, 1),
                                    (32, 256, 512, 1)]],
    "da": [dict(BM=bm, BK=bk, CH=ch, num_warps=w, num_stages=s)
           for bm, bk, ch, w, s in [(64, 128, 1024, 4, 3), (64, 256, 1024, 8, 3), (128, 128, 1024, 8, 3),
                                    (64, 128, 512, 4, 4), (64, 128, 2048, 4, 3), (32, 256, 512, 4, 5)]],
}

WARMUP_MS, REP_MS = 10, 40
T0 = time.monotonic()


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


class _Caches(list):
    """[the table cache the jobs use]: the kernels as they run now, or (``before()``) as they ran before
    launches per rank block (every slot at the largest block, dS and dB in one pass)."""

    def __init__(self):
        super().__init__([TableCache()])
        self.now, self.old = self[0], TableCache(one_block=True)

    def use(self, old: bool):
        self[0] = self.old if old else self.now


def _jobs(m, k, n, ranks, dev, dt, p, lowrank_dx, caches):
    """kernel -> [((m, n, k) of its bucket, run(check=False))] on random operands of this case."""
    torch.manual_seed(0)
    routing = _routing(m, ranks, not lowrank_dx)
    # one table cache per case, as the layers keep one per microbatch: the routing tables of a block size
    # are built on a config's first call and reused, so the timing is the kernel's, not host-side table
    # building (a fresh cache per call made configs with more row chunks look slower)
    st = TableCache().slot_tables(ranks, [2.0] * len(ranks), [p] * len(ranks), list(range(len(ranks))), dev)
    ids = TableCache().row_ids(routing, dev)
    rt = sum(ranks)
    x = torch.randn(m, k, device=dev, dtype=dt)
    W = (torch.randn(n, k, device=dev) / k**0.5).to(dt)
    A = (torch.randn(rt, k, device=dev) / k**0.5).to(dt)
    B = (torch.randn(n, rt, device=dev) * 0.1).to(dt)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    S = K.lora_shrink(x, A, st, routing, ids, k_total=k, cache=caches[0])
    dS, _ = K.lora_ds_db(dy, B, S, st, routing, cache=caches[0])
    # dY·W, what the da_dx pass adds into (in place: timed runs use dxb, checks a copy of dx0)
    dx0 = dy @ W
    dxb = dx0.clone()
    drop = p > 0
    classes = caches.now.classes(routing, ranks)  # one launch per rank block: a bucket each
    rm = [rmax for _, rmax, _ in classes]
    rk = min(classes[-1][0], 64)  # the low-rank term's rank chunk (its bucket's third entry)

    def shrink(check=False):
        return K.lora_shrink(x, A, st, routing, ids, k_total=k, cache=caches[0])

    def ds_db(check=False):
        return K.lora_ds_db(dy, B, S, st, routing, cache=caches[0])

    def da(check=False):
        return K.lora_da(x, dS, st, routing, ids, k_total=k, cache=caches[0])

    def da_dx(check=False):
        return K.lora_da_dx(x, dS, A, dx0.clone() if check else dxb, st, routing, ids, k_total=k,
                            cache=caches[0])

    return {
        "gemm": [((m, n, k), lambda check=False: K.lora_gemm(x, W.t(), None, S, B.t(), st.scale, st, routing,
                                                             n=n, cache=caches[0])),
                 ((m, k, n), lambda check=False: K.lora_gemm(dy, W, None, dS, A, st.inv_keep, st, routing,
                                                             n=k, dropout=drop, row_ids=ids, k_total=k,
                                                             cache=caches[0]))],
        "lowrank": [((m, n, rk), lambda check=False: K.lora_gemm(None, None, None, S, B.t(), st.scale, st,
                                                                routing, n=n, cache=caches[0])),
                    ((m, k, rk), lambda check=False: K.lora_gemm(None, None, None, dS, A, st.inv_keep, st,
                                                                routing, n=k, dropout=drop, row_ids=ids,
                                                                k_total=k, cache=caches[0]))]
                   [: 2 if lowrank_dx else 1],  # the dX variant (main_gemm "triton" only) would share a
                                                # bucket with the forward of an n == k linear
        "shrink": [((m, r, k), shrink) for r in rm],
        "ds_db": [((m, n, r), ds_db) for r in rm],
        "da": [((m, r, k), da) for r in rm],
        "da_dx": [((m, r, k), da_dx) for r in rm],
    }


def _mask_cost(m, k, n, ranks, dev, dt, kernels) -> dict:
    """The masked kernels (shrink, da_dx) at their chosen configs without dropout: what the mask costs."""
    jobs = _jobs(m, k, n, ranks, dev, dt, 0.0, False, _Caches())
    return {kern: timeit(jobs[kern][0][1]) for kern in ("shrink", "da_dx") if kern in kernels}


def _before_after(run, caches, shipped: dict) -> tuple[float, float]:
    """The launcher's time as shipped (the shipped configs, the da_dx pass without prefetching, one launch
    at the largest rank block: ``caches.use(True)``), and now."""
    table, now, default = tuning.tuned_table(), dict(tuning.tuned_table()), tuning.DEFAULTS["da_dx"]
    table.clear()
    table.update({key: dict(cfg, PREFETCH=0) if key[0] == "da_dx" else cfg for key, cfg in shipped.items()})
    tuning.DEFAULTS["da_dx"] = dict(default, PREFETCH=0)
    K._CONFIGS.clear()
    caches.use(True)
    try:
        before = timeit(run)
    finally:
        caches.use(False)
        tuning.DEFAULTS["da_dx"] = default
        table.clear()
        table.update(now)
        K._CONFIGS.clear()
    return before, timeit(run)


def _tune_case(args, case, kernels, done, results, shipped) -> list[dict]:
    """Tune every bucket of one case (m, k, n, ranks) not tuned yet; per kernel its before/after time."""
    m, k, n, ranks = case
    caches = _Caches()
    jobs = _jobs(m, k, n, ranks, args.device, args.dtype, 0.1, not args.shapes, caches)
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
    out = []
    for kernel in kernels:
        run = jobs[kernel][0][1]  # every bucket of a kernel runs the same launcher
        before, after = _before_after(run, caches, shipped)
        out.append({"case": label, "shape": [m, k, n], "ranks": ranks, "kernel": kernel,
                    "before_ms": before, "after_ms": after, "speedup": round(before / after, 3)})
        print(f"{label} {m},{k},{n} {kernel}: before {before:.4f} ms, after {after:.4f} ms "
              f"(t={time.monotonic() - T0:.0f} s)", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tuned.json")
    ap.add_argument("--summary", help="also write each case's kernels' times before and after here")
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
    args.dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    if args.device == "cpu":
        timeit = _wall_ms
    os.environ.pop("LORAFUSION_TUNING_FILE", None)
    shipped = dict(tuning.tuned_table())
    results, done, masks, cases = [], set(), [], []
    for case in _cases(args):
        cases += _tune_case(args, case, kernels, done, results, shipped)
        m, k, n, ranks = case
        if args.mask_cost and len(set(ranks)) == 1:
            masks.append({"shape": [m, k, n], "ranks": ranks, "no_dropout_ms": _mask_cost(
                m, k, n, ranks, args.device, args.dtype, kernels)})
            print(f"no dropout {m},{k},{n}: {masks[-1]['no_dropout_ms']}", flush=True)
        _write(args, results, cases, masks)  # after every case: a run cut short keeps what it chose
    print(f"wrote {len(results)} configs to {args.out}")


def _write(args, results, cases, masks):
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.summary:
        totals: dict = {}
        for c in cases:
            t = totals.setdefault(f"{c['shape'][0]} {c['case']} {c['kernel']}",
                                  {"before_ms": 0.0, "after_ms": 0.0})
            t["before_ms"] += c["before_ms"]
            t["after_ms"] += c["after_ms"]
        with open(args.summary, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "totals_over_linears": totals, "by_linear": cases, "mask_cost": masks,
                       "tuned": results}, f, indent=1)


if __name__ == "__main__":
    main()
