#!/usr/bin/env python
"""Issue 24's levers, each alone, at the LLaMA-3.1-8B shape on one GPU (CUDA events, medians):

  attention  packed causal attention over a realistic microbatch (lognormal sample lengths of the four bench
             datasets packed up to --tokens; 32 query heads, 8 kv heads, d=128) as training runs it
             (lorafusion.models.attention.varlen_attention: FlashAttention-2 varlen through torch's
             varlen_attn), forward alone and forward+backward: one decoder layer's attention. (cuDNN's ragged
             path through ATen was measured here at commit 076eaf7 and dropped: docs/BENCHMARKS.md, issue 24.)
  lora       the 8B's four LoRA linears at m = --tokens (qkv 4096→6144, proj 4096→4096, fc1 4096→28672,
             fc2 14336→4096), forward+backward eager (host included, tables built once per batch as the
             layers do): the frozen base alone; one r=16 adapter; four r=16 adapters in four segments
             (FusedMultiLoRA); one r=64 adapter (the same total rank) — each with main_gemm "cublas" (dX:
             cuBLAS then a Triton pass adds the low-rank term) and "cublas_fold" (the low-rank dX term
             first, cuBLAS adds dY·W into it).
  gemm       cuBLAS alone at those linears: the base GEMMs with and without the low-rank term as C, and with the
             LoRA term folded into their K / N dimension (see bench_gemm).

    python3 scripts/bench_speed24.py [--only attention,gemm,lora] [--tokens 12288] [--out FILE]

Prints one line per measurement and, last, one JSON object with every number (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def median_ms(fn, warmup: int = 5, reps: int = 20) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def packed_lengths(tokens: int, seed: int) -> list[int]:
    """Samples drawn from the bench datasets' length profiles (round robin), packed up to ``tokens``."""
    import numpy as np

    from lorafusion.core.lengths import LENGTH_PROFILES

    rng = np.random.default_rng(seed)
    profiles = list(LENGTH_PROFILES.values())
    out, total, i = [], 0, 0
    while True:
        med, sigma = profiles[i % len(profiles)]
        n = int(min(4096, max(16, rng.lognormal(math.log(med), sigma))))
        if total + n > tokens:
            break
        out.append(n)
        total += n
        i += 1
    return out


def _qkv(lengths, h=32, g=8, d=128, dtype=torch.bfloat16):
    t = sum(lengths)
    q = torch.randn(t, h, d, device="cuda", dtype=dtype)
    k = torch.randn(t, g, d, device="cuda", dtype=dtype)
    v = torch.randn(t, g, d, device="cuda", dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def bench_attention(tokens: int) -> dict:
    import lorafusion.models.attention as att

    lengths = packed_lengths(tokens, 0)
    q, k, v, cu = _qkv(lengths)
    mx, scale = max(lengths), 1 / math.sqrt(128)
    dout = torch.randn_like(q)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]

    def fwd():
        with torch.no_grad():
            att.varlen_attention(q, k, v, cu, mx, scale)

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        att.varlen_attention(*leaves, cu, mx, scale).backward(dout)

    res = {"tokens": sum(lengths), "samples": len(lengths), "max_seqlen": mx,
           "ms": {"fwd": median_ms(fwd), "fwd_bwd": median_ms(fwd_bwd)}}
    print(f"attention (FA2 varlen) {res['tokens']} tokens, {res['samples']} samples: fwd {res['ms']['fwd']:.3f} ms, "
          f"fwd+bwd {res['ms']['fwd_bwd']:.3f} ms", flush=True)
    return res


LINEARS = {"qkv": (4096, 6144), "proj": (4096, 4096), "fc1": (4096, 28672), "fc2": (14336, 4096)}


def _lora_row(m: int, k: int, n: int) -> dict:
    from lorafusion.core.routing import Routing
    from lorafusion.ops.tables import TableCache
    from lorafusion.ops.fused import multi_lora_linear_fused

    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    quarter = [m // 4] * 3 + [m - 3 * (m // 4)]
    cases = {"single_r16": ([16], Routing.single(m)),
             "multi_4x16": ([16] * 4, Routing.from_lengths([0, 1, 2, 3], quarter)),
             "single_r64": ([64], Routing.single(m))}

    def base():
        x.grad = None
        torch.nn.functional.linear(x, W).backward(g)

    row = {"base": median_ms(base)}
    for cname, (ranks, routing) in cases.items():
        A = [(torch.randn(r, k, device="cuda") / k**0.5).requires_grad_(True) for r in ranks]
        B = [(torch.randn(n, r, device="cuda") * 0.01).requires_grad_(True) for r in ranks]
        tc, nr = TableCache(), len(ranks)
        for mg in MAIN_GEMMS:
            def step(A=A, B=B, routing=routing, tc=tc, mg=mg, nr=nr):
                for t in (x, *A, *B):
                    t.grad = None
                y = multi_lora_linear_fused(x, W, None, A, B, [2.0] * nr, [0.1] * nr, list(range(7, 7 + nr)),
                                            routing, cache=tc, main_gemm=mg)
                y.backward(g)

            row[f"{cname}_{mg}"] = median_ms(step)
            if PROFILE_KERNELS and mg == "cublas":
                row[f"{cname}_kernels_us"] = kernel_times(step)
    row["multi_over_single_r16"] = row["multi_4x16_cublas"] / row["single_r16_cublas"]
    row["multi_over_single_r64"] = row["multi_4x16_cublas"] / row["single_r64_cublas"]
    if "multi_4x16_cublas_fold" in row:
        row["fold_over_cublas_multi"] = row["multi_4x16_cublas_fold"] / row["multi_4x16_cublas"]
    return row


PROFILE_KERNELS = False
MAIN_GEMMS = ("cublas", "cublas_fold")


def kernel_times(fn, reps: int = 5) -> dict:
    """Device time per call (µs) of each CUDA kernel ``fn`` launches, by name, over ``reps`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by: dict[str, float] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name[:60]] = by.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / reps
    return dict(sorted(((k, round(v, 1)) for k, v in by.items()), key=lambda kv: -kv[1]))


def bench_gemm(tokens: int, linears: list[str] | None = None, extra: int = 64) -> dict:
    """cuBLAS alone at the 8B's linears (m = ``tokens``, bf16): what the LoRA term costs the base GEMMs and what
    folding it into their K (forward) or N (input gradient) dimension would cost instead:

      fwd_beta0   Y = X·Wᵀ                       the frozen base alone
      fwd_beta1   Y += X·Wᵀ (C = the low-rank term, in place: what the fused forward's addmm_ does)
      fwd_k_aug   [X | s·S]·[W | B]ᵀ with K = k + ``extra`` (X and W as strided views of wider buffers)
      dx_beta0    dX = dY·W
      dx_n_aug    [dY | dS]·[W ; A] with the inner dimension n + ``extra`` (dropout 0 only: the mask is per element)
    """
    out = {}
    bf = torch.bfloat16
    for lname, (k, n) in LINEARS.items():
        if linears and lname not in linears:
            continue
        torch.manual_seed(0)
        xa = torch.randn(tokens, k + extra, device="cuda", dtype=bf)
        wa = torch.randn(n, k + extra, device="cuda", dtype=bf) / k**0.5
        x, w = xa[:, :k], wa[:, :k]  # strided views: the plain GEMMs below get contiguous copies
        xc, wc = x.contiguous(), w.contiguous()
        c = torch.randn(tokens, n, device="cuda", dtype=bf)
        dya = torch.randn(tokens, n + extra, device="cuda", dtype=bf)
        dyc = dya[:, :n].contiguous()
        wr = torch.randn(n + extra, k, device="cuda", dtype=bf) / k**0.5
        row = {"fwd_beta0": median_ms(lambda: torch.mm(xc, wc.t())),
               "fwd_beta1": median_ms(lambda: c.addmm_(xc, wc.t())),
               "fwd_k_aug": median_ms(lambda: torch.mm(xa, wa.t())),
               "dx_beta0": median_ms(lambda: torch.mm(dyc, wr[:n])),
               "dx_n_aug": median_ms(lambda: torch.mm(dya, wr))}
        out[lname] = row
        print(f"gemm {lname} m={tokens} k={k} n={n}: " + ", ".join(f"{a} {b:.3f}" for a, b in row.items()), flush=True)
    return out


def bench_lora(tokens: int, linears: list[str] | None = None) -> dict:
    out = {}
    for lname, (k, n) in LINEARS.items():
        if linears and lname not in linears:
            continue
        row = out[lname] = _lora_row(tokens, k, n)
        print(f"lora {lname} m={tokens} k={k} n={n}: " + ", ".join(f"{a} {b:.3f}" for a, b in row.items()
                                                                 if isinstance(b, float)), flush=True)
        for a, b in row.items():
            if isinstance(b, dict):
                print(f"  {a}: " + ", ".join(f"{kn} {us:.1f}" for kn, us in list(b.items())[:12]), flush=True)
    first = next(iter(out.values()))
    tot = {key: sum(r[key] for r in out.values()) for key in first if "_over_" not in key and "_kernels" not in key}
    out["sum_4_linears"] = tot
    print("lora, sum over the 4 linears (ms): " + ", ".join(f"{a} {b:.3f}" for a, b in tot.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated parts to run, of attention, gemm, lora (default: all)")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--out")
    ap.add_argument("--linears", nargs="+", choices=list(LINEARS), help="lora: only these linears")
    ap.add_argument("--main-gemms", default="cublas,cublas_fold", help="lora: main_gemm variants to time")
    ap.add_argument("--kernels", action="store_true", help="lora: also device time per kernel (torch.profiler)")
    args = ap.parse_args()
    global PROFILE_KERNELS, MAIN_GEMMS
    PROFILE_KERNELS = args.kernels
    MAIN_GEMMS = tuple(args.main_gemms.split(","))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "tokens": args.tokens}
    for name, fn in (("attention", bench_attention), ("gemm", lambda t: bench_gemm(t, args.linears)),
                     ("lora", lambda t: bench_lora(t, args.linears))):
        if args.only is None or name in args.only.split(","):
            try:
                res[name] = fn(args.tokens)
            except Exception as e:  # keep the other lever's numbers
                import traceback

                traceback.print_exc()
                res[f"{name}_error"] = repr(e)[:500]
    line = json.dumps(res)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
