#!/usr/bin/env python
"""Benchmark FusedLoRA / FusedMultiLoRA against the frozen base linear and torch LoRA (forward + backward).

For each shape (m, k, n) with r=16, p=0.1, bf16: median times (triton.testing.do_bench, CUDA events, L2
flushed between runs) of
  base      y = x·Wᵀ, backward dX only (W frozen)
  eager     PEFT-style torch LoRA: base + s·dropout(x)·Aᵀ·Bᵀ, grads for x, A, B
  compile   the same function under torch.compile
  fused     FusedLoRA (lorafusion.ops.fused.fused_lora_linear), main GEMM in Triton (one GEMM, LoRA in its
            accumulator) and, as "fused_cublas", low-rank term by Triton + X·Wᵀ by cuBLAS addmm
as ratios to base measured in the same run, plus bytes saved for backward (activations, parameters excluded).
Multi-adapter: 4 adapters, ranks {8,16,32,64}, segments 37/29/21/13% of m tokens: FusedMultiLoRA vs a
per-adapter torch loop vs single-adapter FusedLoRA at equal tokens (r=16 and r=64).
--breakdown times each kernel alone. The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _bench import median_ms, run_info, write_json  # noqa: E402

SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 4096, 4096),
          (4096, 8192, 8192)]


def bench(fn, grad_to_none=None, warmup=25, rep=100) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                       return_mode="median")
    return median_ms(fn, warmup=0, iters=3)


def graph_ms(fn, gtn, warmup, rep) -> float | None:
    """Median time of a CUDA-graph replay of ``fn`` (forward + backward): device time without host launch
    overhead. None if ``fn`` cannot be captured."""
    if not torch.cuda.is_available():
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                for t in gtn:
                    t.grad = None
                fn()
        torch.cuda.current_stream().wait_stream(side)
        for t in gtn:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return bench(graph.replay, None, warmup, rep)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"   (graph capture failed: {type(e).__name__}: {str(e)[:120]})")
        torch.cuda.synchronize()
        return None


def interleaved_graph(ref, variants, gtn, warmup, rep):
    """Like :func:`interleaved`, on CUDA-graph replays."""
    ms, ratio = {}, {}
    refs = [graph_ms(ref, gtn, warmup, rep)]
    for name, fn in variants:
        t = graph_ms(fn, gtn, warmup, rep)
        refs.append(graph_ms(ref, gtn, warmup, rep))
        ms[name] = t
        ratio[name] = None if t is None else t / ((refs[-2] + refs[-1]) / 2)
    return ms, ratio, refs


def saved_bytes(fn, exclude) -> int:
    """Bytes of distinct storages autograd saves during one forward, parameters in ``exclude`` left out."""
    seen = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    del y
    return sum(seen.values())


def peft_lora(x, W, A, B, s, p):
    return F.linear(x, W) + F.linear(F.linear(F.dropout(x, p, training=True), A), B) * s


def peft_multi_loop(x, W, As, Bs, ss, ps, lengths):
    y = F.linear(x, W)
    outs, pos = [], 0
    for A, B, s, p, n in zip(As, Bs, ss, ps, lengths, strict=True):
        xs = x[pos:pos + n]
        outs.append(F.linear(F.linear(F.dropout(xs, p, training=True), A), B) * s)
        pos += n
    return y + torch.cat(outs)


def set_main_gemm(v):
    os.environ["LORAFUSION_MAIN_GEMM"] = v  # read by tuning.default_main_gemm() at each call


def cpu_ms(fn, n=10) -> float:
    """Host time to enqueue one call (device idle before each): above the device time means launch-bound."""
    ts = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sorted(ts)[len(ts) // 2]


def interleaved(ref, variants, gtn, warmup, rep):
    """Time ``ref`` between every two variants; each variant's ratio is to the mean of its two neighbouring
    ``ref`` times (clock and thermal drift cancel). Returns (ms per variant, ratio per variant, ref times)."""
    ms, ratio = {}, {}
    refs = [bench(ref, gtn, warmup, rep)]
    for name, fn in variants:
        t = bench(fn, gtn, warmup, rep)
        refs.append(bench(ref, gtn, warmup, rep))
        ms[name] = t
        ratio[name] = t / ((refs[-2] + refs[-1]) / 2)
    return ms, ratio, refs


def with_gemm(mg, fn):
    def run():
        set_main_gemm(mg)
        fn()
    return run


def single_shape(m, k, n, r, p, dtype, dev, do_compile, warmup, rep):
    from lorafusion.ops.fused import fused_lora_linear

    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
    W = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
    A = (torch.randn(r, k, device=dev) / k**0.5).to(dtype).requires_grad_(True)
    B = (torch.randn(n, r, device=dev) * 0.1).to(dtype).requires_grad_(True)
    g = torch.randn(m, n, device=dev, dtype=dtype)
    s = 2.0

    def base():
        F.linear(x, W).backward(g)

    def eager():
        peft_lora(x, W, A, B, s, p).backward(g)

    seed_counter = itertools.count(1000)
    # one batch's routing and table cache across calls, as the LoRA layers share them per microbatch
    from lorafusion.core.routing import Routing
    from lorafusion.ops.tables import TableCache

    rt, tc = Routing.single(m), TableCache()

    def fused(pp=p):  # a new Philox seed every call, as in training
        fused_lora_linear(x, W, None, A, B, s, pp, next(seed_counter), routing=rt, cache=tc).backward(g)

    def fused_fixed(pp=p):  # graph capture: the seed is part of the captured call
        fused_lora_linear(x, W, None, A, B, s, pp, 1234, routing=rt, cache=tc).backward(g)

    variants = [("eager", eager)]
    if do_compile:
        comp = torch.compile(peft_lora)

        def compiled():
            comp(x, W, A, B, s, p).backward(g)

        compiled()  # build outside the timed region
        variants.append(("compile", compiled))
    variants += [("fused", with_gemm("triton", fused)), ("fused_p0", with_gemm("triton", lambda: fused(0.0))),
                 ("fused_cublas", with_gemm("cublas", fused)),
                 ("fused_cublas_p0", with_gemm("cublas", lambda: fused(0.0)))]
    ms, ratio, refs = interleaved(base, variants, [x, A, B], warmup, rep)
    ms["base"] = sorted(refs)[len(refs) // 2]
    gvariants = [("eager", eager)] + [v for v in variants if v[0] == "compile"] + [
        ("fused", with_gemm("triton", fused_fixed)),
        ("fused_p0", with_gemm("triton", lambda: fused_fixed(0.0))),
        ("fused_cublas", with_gemm("cublas", fused_fixed)),
        ("fused_cublas_p0", with_gemm("cublas", lambda: fused_fixed(0.0)))]
    gms, gratio, grefs = interleaved_graph(base, gvariants, [x, A, B], warmup, rep)
    if torch.cuda.is_available():
        gms["base"] = sorted(grefs)[len(grefs) // 2]
        ms.update({f"graph_{key}": v for key, v in gms.items()})
        ratio.update({f"graph_{key}": v for key, v in gratio.items()})
    extra = {"base_spread": (max(refs) - min(refs)) / ms["base"],
             "cpu_ms_fused": cpu_ms(with_gemm("triton", fused)),
             "cpu_ms_fused_cublas": cpu_ms(with_gemm("cublas", fused))}
    set_main_gemm("triton")
    params = [W, A, B]
    mem = {
        "eager": saved_bytes(lambda: peft_lora(x, W, A, B, s, p), params),
        "fused": saved_bytes(lambda: fused_lora_linear(x, W, None, A, B, s, p, 1234), params),
    }
    return ms, ratio, extra, mem


def multi(m, k, n, dtype, dev, warmup, rep):
    from lorafusion.core.routing import Routing
    from lorafusion.ops.tables import TableCache
    from lorafusion.ops.fused import fused_lora_linear, multi_lora_linear_fused

    torch.manual_seed(1)
    ranks = [8, 16, 32, 64]
    frac = [0.37, 0.29, 0.21]
    lengths = [int(m * f) for f in frac]
    lengths.append(m - sum(lengths))
    routing = Routing.from_lengths([0, 1, 2, 3], lengths)
    x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
    W = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
    As = [(torch.randn(r, k, device=dev) / k**0.5).to(dtype).requires_grad_(True) for r in ranks]
    Bs = [(torch.randn(n, r, device=dev) * 0.1).to(dtype).requires_grad_(True) for r in ranks]
    ss, ps, seeds = [2.0, 1.0, 0.5, 0.25], [0.1] * 4, [11, 12, 13, 14]
    g = torch.randn(m, n, device=dev, dtype=dtype)
    gtn = [x, *As, *Bs]
    tc, single_rt = TableCache(), Routing.single(m)  # tables built once per batch, as in training

    def fmulti():
        multi_lora_linear_fused(x, W, None, As, Bs, ss, ps, seeds, routing, cache=tc).backward(g)

    def loop():
        peft_multi_loop(x, W, As, Bs, ss, ps, lengths).backward(g)

    def single(i):
        return lambda: fused_lora_linear(x, W, None, As[i], Bs[i], ss[i], 0.1, 7, routing=single_rt,
                                         cache=tc).backward(g)

    out = {"lengths": lengths, "ms": {}, "ratios": {}}
    for mg in ("triton", "cublas"):
        sfx = "" if mg == "triton" else "_cublas"
        for ref_name, ref_i in (("single_r16", 1), ("single_r64", 3)):
            for mode, timer in (("", interleaved), ("graph_", interleaved_graph)):
                if mode and not torch.cuda.is_available():
                    continue
                ms, ratio, refs = timer(with_gemm(mg, single(ref_i)), [("multi", with_gemm(mg, fmulti))], gtn,
                                        warmup, rep)
                out["ms"][f"{mode}fused_{ref_name}{sfx}"] = sorted(refs)[1]
                out["ms"][f"{mode}fused_multi{sfx}_vs_{ref_name}"] = ms["multi"]
                out["ratios"][f"{mode}multi_over_{ref_name}{sfx}"] = ratio["multi"]
    set_main_gemm("triton")
    ms, ratio, refs = interleaved(lambda: F.linear(x, W).backward(g),
                                  [("torch_loop", loop), ("fused_multi", with_gemm("triton", fmulti)),
                                   ("fused_multi_cublas", with_gemm("cublas", fmulti))], gtn, warmup, rep)
    set_main_gemm("triton")
    out["ms"].update(ms)
    out["ms"]["base"] = sorted(refs)[len(refs) // 2]
    out["ratios"].update({f"{key}_over_base": v for key, v in ratio.items()})
    return out


def breakdown(m, k, n, r, dtype, dev, warmup, rep):
    """Each kernel alone (and the cuBLAS GEMMs it competes with)."""
    from lorafusion.core.routing import Routing
    from lorafusion.kernels import fused_multi_lora as K
    from lorafusion.ops.tables import TableCache

    torch.manual_seed(2)
    routing = Routing.single(m)
    empty = Routing(segments=(), num_rows=m)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    W = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
    A = (torch.randn(r, k, device=dev) / k**0.5).to(dtype)
    B = (torch.randn(n, r, device=dev) * 0.1).to(dtype)
    dy = torch.randn(m, n, device=dev, dtype=dtype)
    ids = TableCache().row_ids(routing, dev)
    out = {}
    for p in (0.1, 0.0):
        st = TableCache().slot_tables([r], [2.0], [p], [99], dev)
        tag = f"p{p:g}"
        S = K.lora_shrink(x, A, st, routing, ids, k_total=k, cache=TableCache())
        dS, _ = K.lora_ds_db(dy, B, S, st, routing, cache=TableCache())
        out[f"shrink_{tag}"] = bench(
            lambda: K.lora_shrink(x, A, st, routing, ids, k_total=k, cache=TableCache()), None, warmup, rep)
        out[f"da_{tag}"] = bench(lambda: K.lora_da(x, dS, st, routing, ids, k_total=k, cache=TableCache()),
                                 None, warmup, rep)
        out[f"dx_gemm_lora_{tag}"] = bench(
            lambda: K.lora_gemm(dy, W, None, dS, A, st.inv_keep, st, routing, n=k,
                                dropout=st.dropout, row_ids=ids, k_total=k, cache=TableCache()),
            None, warmup, rep)
        dxb = dy @ W
        out[f"da_dx_acc_{tag}"] = bench(
            lambda: K.lora_da_dx(x, dS, A, dxb, st, routing, ids, k_total=k, cache=TableCache()), None,
            warmup, rep)
        out[f"dx_lowrank_{tag}"] = bench(
            lambda: K.lora_gemm(None, None, None, dS, A, st.inv_keep, st, routing, n=k,
                                dropout=st.dropout, row_ids=ids, k_total=k, cache=TableCache()),
            None, warmup, rep)
    out["ds_db"] = bench(lambda: K.lora_ds_db(dy, B, S, st, routing, cache=TableCache()), None, warmup, rep)
    out["fwd_gemm_lora"] = bench(
        lambda: K.lora_gemm(x, W.t(), None, S, B.t(), st.scale, st, routing, n=n, cache=TableCache()),
        None, warmup, rep)
    out["fwd_gemm_triton_nolora"] = bench(
        lambda: K.lora_gemm(x, W.t(), None, S, B.t(), st.scale, st, empty, n=n, cache=TableCache()),
        None, warmup, rep)
    out["fwd_lowrank"] = bench(
        lambda: K.lora_gemm(None, None, None, S, B.t(), st.scale, st, routing, n=n, cache=TableCache()),
        None, warmup, rep)
    lr = K.lora_gemm(None, None, None, S, B.t(), st.scale, st, routing, n=n, cache=TableCache())
    out["fwd_cublas_addmm_beta1"] = bench(lambda: torch.addmm(lr, x, W.t()), None, warmup, rep)
    out["fwd_cublas"] = bench(lambda: F.linear(x, W), None, warmup, rep)
    out["dx_cublas"] = bench(lambda: dy @ W, None, warmup, rep)
    out["copy_x"] = bench(lambda: x.clone(), None, warmup, rep)
    return out


def profile_host(smoke: bool):
    """Host (enqueue) time of each piece of a FusedLoRA forward+backward, device idle before each call."""
    import cProfile
    import pstats

    from lorafusion.core.routing import Routing
    from lorafusion.kernels import fused_multi_lora as K
    from lorafusion.ops.tables import TableCache
    from lorafusion.ops.fused import fused_lora_linear

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    m, k, n = (8192, 4096, 4096) if not smoke else (64, 48, 40)
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    W = torch.randn(n, k, device=dev, dtype=dt)
    A = torch.randn(16, k, device=dev, dtype=dt, requires_grad=True)
    B = torch.randn(n, 16, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(m, n, device=dev, dtype=dt)
    routing = Routing.single(m)
    tc = TableCache()
    ids = tc.row_ids(routing, dev)
    seeds = itertools.count(10)
    st = tc.slot_tables([16], [2.0], [0.1], [1], dev)
    seed_dev = torch.tensor([1], dtype=torch.int64, device=dev)
    S = K.lora_shrink(x.detach(), A.detach(), st, routing, ids, k_total=k, cache=TableCache())
    Bt = B.detach().t().contiguous()
    pieces = {
        "slot_tables (new seed)": lambda: tc.slot_tables([16], [2.0], [0.1], [next(seeds)], dev),
        "slot_tables (seeds on device)": lambda: tc.slot_tables([16], [2.0], [0.1], seed_dev, dev),
        "launch shrink": lambda: K.lora_shrink(x.detach(), A.detach(), st, routing, ids, k_total=k,
                                               cache=TableCache()),
        "launch lowrank": lambda: K.lora_gemm(None, None, None, S, Bt, st.scale, st, routing, n=n,
                                              cache=TableCache()),
        "torch.empty": lambda: torch.empty(m, 16, device=dev, dtype=dt),
        "F.linear (cuBLAS)": lambda: F.linear(x.detach(), W),
        "fused forward only": lambda: fused_lora_linear(x, W, None, A, B, 2.0, 0.1, next(seeds),
                                                        routing=routing, cache=tc),
        "fused fwd+bwd": lambda: fused_lora_linear(x, W, None, A, B, 2.0, 0.1, next(seeds), routing=routing,
                                                   cache=tc).backward(g),
        "torch eager LoRA fwd+bwd": lambda: peft_lora(x, W, A, B, 2.0, 0.1).backward(g),
        "base fwd+bwd": lambda: F.linear(x, W).backward(g),
    }
    for name, fn in pieces.items():
        for _ in range(3):
            fn()
        print(f"host us {name:28s} {cpu_ms(fn, 30) * 1e3:9.1f}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        if dev == "cuda":
            torch.cuda.synchronize()
        pieces["fused fwd+bwd"]()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats(25)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all", help="'all' or comma list of indices into the five shapes")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to build)")
    ap.add_argument("--no-multi", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="also time each kernel alone")
    ap.add_argument("--warmup", type=int, default=25, help="ms (do_bench)")
    ap.add_argument("--rep", type=int, default=100, help="ms (do_bench)")
    ap.add_argument("--out", help="also write the JSON record here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU/interpreter check of the script)")
    ap.add_argument("--profile-host", action="store_true",
                    help="cProfile the host side of fused fwd+bwd, then exit")
    args = ap.parse_args()
    if args.profile_host:
        profile_host(args.smoke)
        return

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.smoke:
        shapes = [(64, 48, 40)]
    report = {**run_info(), "torch": torch.__version__, "r": args.r, "p": args.p, "dtype": str(dtype),
              "single": [], "multi": None, "breakdown": []}
    import triton

    report["triton"] = triton.__version__
    hdr = (f"{'m,k,n':>20} {'base ms':>8} {'eager':>7} {'compile':>7} {'fused':>7} {'f_cublas':>8} "
           f"{'f_p0':>6} {'fc_p0':>6} {'spread':>6} {'cpu ms f/fc':>12} {'saved MiB eager/fused':>22}")
    print(hdr)
    for (m, k, n) in shapes:
        ms, ratios, extra, mem = single_shape(m, k, n, args.r, args.p, dtype, dev,
                                              not args.no_compile and not args.smoke, args.warmup, args.rep)
        report["single"].append({"m": m, "k": k, "n": n, "ms": ms, "ratio_to_base": ratios, "extra": extra,
                                 "saved_bytes": mem})
        c = f"{ratios['compile']:.3f}" if "compile" in ratios else "-"
        print(f"{str((m, k, n)):>20} {ms['base']:8.3f} {ratios['eager']:7.3f} {c:>7} {ratios['fused']:7.3f} "
              f"{ratios['fused_cublas']:8.3f} {ratios['fused_p0']:6.3f} {ratios['fused_cublas_p0']:6.3f} "
              f"{extra['base_spread']:6.3f} {extra['cpu_ms_fused']:5.3f}/{extra['cpu_ms_fused_cublas']:5.3f} "
              f"{mem['eager'] / 2**20:10.1f}/{mem['fused'] / 2**20:.1f}", flush=True)
        if "graph_fused" in ratios:
            gr = {key: ("-" if v is None else f"{v:.3f}") for key, v in ratios.items()}
            print(f"{'  graph replay:':>20} {ms['graph_base']:8.3f} {gr['graph_eager']:>7} "
                  f"{gr.get('graph_compile', '-'):>7} {gr['graph_fused']:>7} {gr['graph_fused_cublas']:>8} "
                  f"{gr['graph_fused_p0']:>6} {gr['graph_fused_cublas_p0']:>6}", flush=True)
        if args.breakdown:
            bd = breakdown(m, k, n, args.r, dtype, dev, args.warmup, args.rep)
            report["breakdown"].append({"m": m, "k": k, "n": n, "ms": bd})
            print("   breakdown ms: " + ", ".join(f"{key}={v:.4f}" for key, v in bd.items()), flush=True)
    if not args.no_multi:
        m, k, n = (8192, 4096, 4096) if not args.smoke else (64, 48, 40)
        res = multi(m, k, n, dtype, dev, args.warmup, args.rep)
        report["multi"] = {"m": m, "k": k, "n": n, "ranks": [8, 16, 32, 64], **res}
        print("multi (4 adapters, r 8/16/32/64, segments " + "/".join(map(str, res["lengths"])) + "): " +
              ", ".join(f"{key}={v:.3f}ms" for key, v in res["ms"].items()))
        print("multi ratios: " + ", ".join(f"{key}={v:.3f}" for key, v in res["ratios"].items()))
    write_json(report, args.out, indent=1)


if __name__ == "__main__":
    main()
