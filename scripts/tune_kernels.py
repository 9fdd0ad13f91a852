#!/usr/bin/env python
"""Choose block configs per kernel and shape bucket on this GPU; write them as JSON.

Times each candidate with triton.testing.do_bench (median, CUDA events) on the five benchmark shapes
(r=16, p=0.1, bf16) and the multi-adapter case (r_max=64), or on ``--shapes`` (m,k,n of a model's linears)
with ``--segments`` equal r=16 adapter segments, and keeps the fastest per (kernel, bucket). A candidate whose
output differs from the default config's (beyond bf16 rounding of the fp32 accumulation order) is rejected.
Paste the result into ``lorafusion/kernels/tuning.py`` (TUNED), or point LORAFUSION_TUNING_FILE at the JSON.

    python scripts/tune_kernels.py --out tuned.json
    python scripts/tune_kernels.py --shapes 12288,4096,6144 12288,4096,28672 --segments 4 \
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

CANDIDATES = {
    "gemm": [dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4),
                                      (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]],
    "lowrank": [dict(BM=bm, BN=bn, GROUP_M=8, num_warps=w, num_stages=1)
                for bm, bn, w in [(64, 128, 4), (128, 128, 8), (64, 256, 4), (128, 256, 8)]],
    "shrink": [dict(BM=bm, BK=bk, num_warps=w, num_stages=s)
               for bm, bk, w, s in [(32, 128, 4, 3), (16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3),
                                    (32, 128, 8, 4), (16, 128, 4, 4)]],
    "ds_db": [dict(BM=bm, BN=bn, CH=ch, num_warps=w, num_stages=s)
              for bm, bn, ch, w, s in [(64, 128, 1024, 4, 3), (64, 256, 1024, 8, 3), (32, 512, 1024, 8, 3),
                                       (16, 512, 1024, 8, 3), (32, 512, 2048, 8, 3), (64, 128, 512, 4, 3)]],
    "da_dx": [dict(BM=bm, BK=bk, CH=ch, num_warps=w, num_stages=s)
              for bm, bk, ch, w, s in [(32, 256, 512, 4, 3), (32, 128, 512, 4, 3), (64, 128, 512, 4, 3),
                                       (32, 256, 512, 8, 3), (64, 256, 1024, 8, 3), (16, 256, 512, 4, 4),
                                       (32, 128, 1024, 4, 4), (64, 64, 512, 4, 3)]],
    "da": [dict(BM=bm, BK=bk, CH=ch, num_warps=w, num_stages=s)
           for bm, bk, ch, w, s in [(64, 128, 1024, 4, 3), (64, 256, 1024, 8, 3), (128, 128, 1024, 8, 3),
                                    (64, 128, 512, 4, 3), (64, 128, 2048, 4, 3), (32, 256, 512, 4, 3)]],
}


def timeit(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


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


def tune_one(kernel, bucket, run):
    best, rows = None, []
    tuning.TUNED.pop((kernel, bucket), None)
    ref = _parts(run(True))  # the default config's output (run(True): on fresh copies of in-place operands)
    for cfg in CANDIDATES[kernel]:
        tuning.TUNED[(kernel, bucket)] = cfg
        try:
            if differs(_parts(run(True)), ref):
                rows.append((cfg, None, "WRONG RESULT"))
                continue
            ms = timeit(run)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            rows.append((cfg, None, type(e).__name__))
            continue
        rows.append((cfg, ms, ""))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    tuning.TUNED.pop((kernel, bucket), None)
    default_ms = next((ms for cfg, ms, _ in rows if cfg == tuning.DEFAULTS[kernel]), None)
    return best, default_ms, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tuned.json")
    ap.add_argument("--kernels", default="gemm,lowrank,shrink,ds_db,da,da_dx")
    ap.add_argument("--shapes", nargs="+", metavar="M,K,N", help="linears to tune at (default: the five "
                    "benchmark shapes and the r 8/16/32/64 multi-adapter case)")
    ap.add_argument("--segments", type=int, default=1, help="with --shapes: equal segments of r=16 adapters")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a dry run under TRITON_INTERPRET=1 (fp32, wall clock)")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    dev, dt = args.device, (torch.bfloat16 if args.device != "cpu" else torch.float32)
    if dev == "cpu":
        global timeit
        timeit = _wall_ms
    os.environ.pop("LORAFUSION_TUNING_FILE", None)
    results = []
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
        if any(len(s) != 3 for s in shapes):
            raise SystemExit(f"--shapes: expected M,K,N triples, got {args.shapes}")
        cases = [(m, k, n, [16] * args.segments) for m, k, n in shapes]
    else:
        cases = [(m, k, n, [16]) for m, k, n in SHAPES] + [(8192, 4096, 4096, [8, 16, 32, 64])]
    done = set()
    for m, k, n, ranks in cases:
        torch.manual_seed(0)
        if len(ranks) == 1:
            routing = Routing.single(m)
        elif len(set(ranks)) == 1:  # equal segments
            ls = [m // len(ranks)] * (len(ranks) - 1)
            routing = Routing.from_lengths(list(range(len(ranks))), ls + [m - sum(ls)])
        else:
            ls = [int(m * f) for f in (0.37, 0.29, 0.21)]
            routing = Routing.from_lengths([0, 1, 2, 3], ls + [m - sum(ls)])
        # one table cache per case, as the layers keep one per microbatch: the routing tables of a block size
        # are built on a config's first call and reused, so the timing is the kernel's, not host-side table
        # building (a fresh cache per call made configs with more row chunks look slower)
        tc = TableCache()
        st = TableCache().slot_tables(ranks, [2.0] * len(ranks), [0.1] * len(ranks),
                                      list(range(len(ranks))), dev)
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
        jobs = {
            "gemm": [((m, n, k), lambda check=False: K.lora_gemm(x, W.t(), None, S, B.t(), st.scale, st,
                                                                 routing, n=n, cache=tc)),
                     ((m, k, n), lambda check=False: K.lora_gemm(dy, W, None, dS, A, st.inv_keep, st,
                                                                 routing, n=k, dropout=True, row_ids=ids,
                                                                 k_total=k, cache=tc))],
            "lowrank": [((m, n, 0), lambda check=False: K.lora_gemm(None, None, None, S, B.t(), st.scale,
                                                                    st, routing, n=n, cache=tc)),
                        ((m, k, 0), lambda check=False: K.lora_gemm(None, None, None, dS, A, st.inv_keep,
                                                                    st, routing, n=k, dropout=True,
                                                                    row_ids=ids, k_total=k, cache=tc))]
                       [: 1 if args.shapes else 2],  # the dX variant (main_gemm "triton" only) would share a
                                                     # bucket with the forward of an n == k linear
            "shrink": [((m, st.r_max, k),
                        lambda check=False: K.lora_shrink(x, A, st, routing, ids, k_total=k, cache=tc))],
            "ds_db": [((m, n, st.r_max), lambda check=False: K.lora_ds_db(dy, B, S, st, routing, cache=tc))],
            "da": [((m, st.r_max, k),
                    lambda check=False: K.lora_da(x, dS, st, routing, ids, k_total=k, cache=tc))],
            "da_dx": [((m, st.r_max, k),
                       lambda check=False: K.lora_da_dx(x, dS, A, dx0.clone() if check else dxb, st, routing,
                                                        ids, k_total=k, cache=tc))],
        }
        for kernel in kernels:
            for shape, run in jobs[kernel]:
                bucket = tuning.bucket(*shape)
                if (kernel, bucket) in done:
                    continue
                done.add((kernel, bucket))
                best, default_ms, rows = tune_one(kernel, bucket, run)
                if best is None:
                    continue
                results.append({"kernel": kernel, "bucket": list(bucket), "config": best[0], "ms": best[1],
                                "default_ms": default_ms, "shape": [m, k, n], "ranks": ranks})
                print(f"{kernel:8s} {str(bucket):22s} best {best[1]:.4f} ms (default {default_ms}) {best[0]}",
                      flush=True)
                for cfg, ms, err in rows:
                    print(f"      {ms if ms is None else round(ms, 4)!s:>8} {err} {cfg}")
                with open(args.out, "w") as f:  # after every bucket: a run cut short keeps what it chose
                    json.dump(results, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {len(results)} configs to {args.out}")


if __name__ == "__main__":
    main()
