"""The FP8 base's row quantization (lorafusion.kernels.fp8_quant) on the 8B's shapes: the shipped kernel, the
former per-element division ("divide") at the same launch, and other launches, each timed and checked bit
for bit against the torch path (lorafusion.ops.fp8_linear.quantize_rows_torch).

Per layer of the 8B (no TP), forward and backward, the FP8 linears quantize 8 activations of ``--tokens``
rows: X of qkv, proj and fc1 (4096 columns), X of fc2 (14336), dY of proj and fc2 (4096, times W's channel
scales), dY of qkv (6144) and of fc1 (28672). ``layer_ms`` sums them per variant family: "divide" (the former
kernel), "shipped", and the fastest launch of each shape ("best", with which launch). ``transpose``: W_q's
transpose that each linear's backward makes (lorafusion.kernels.fp8_quant.transposed_operand), per 8B weight.

    python scripts/bench_fp8_quant.py [--tokens 32768] [--variants few|all] [--out fp8_quant.json]

On a CPU (Triton's interpreter, ``--tokens 4``) it runs every launch once as a smoke test: no times, and q
is not compared (the interpreter's float→fp8 cast does not round to nearest). Last line: JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import median_ms, run_info, write_json  # noqa: E402
from lorafusion.kernels import fp8_quant as Q  # noqa: E402
from lorafusion.ops import fp8_linear as F  # noqa: E402

# (name, columns, column scale?, quantizations of this shape per layer forward + backward)
SHAPES = (("x_4096", 4096, False, 3), ("x_14336", 14336, False, 1), ("dy_4096", 4096, True, 2),
          ("dy_6144", 6144, True, 1), ("dy_28672", 28672, True, 1))
TWO_LOOPS = 1024  # max_single below the row length: the two-loop path


def loops(block: int, warps: int) -> dict:
    """The two-loop launch with ``block``-wide steps and ``warps`` warps."""
    return dict(max_single=TWO_LOOPS, block=block, num_warps=warps)


# launches besides the shipped one (quantize_rows_triton's keywords); "few": the likeliest alternatives
FEW = {"x_4096": {"rows1_w8": dict(rows=1, num_warps=8), "rows2_w8": dict(rows=2, num_warps=8),
                  "rows8_w16": dict(rows=8, num_warps=16)},
       "x_14336": {"loops2k_w4": loops(2048, 4),
                   "loops8k_w16": loops(8192, 16),
                   "one_read_w16": dict(max_single=1 << 16, num_warps=16)},
       "dy_4096": {"rows1_w4": dict(rows=1, num_warps=4), "rows2_w8": dict(rows=2, num_warps=8),
                   "rows4_w16": dict(rows=4, num_warps=16)},
       "dy_6144": {"w16": dict(num_warps=16), "rows2_w16": dict(rows=2, num_warps=16),
                   "loops2k_w4": loops(2048, 4), "loops2k_w8": loops(2048, 8)},
       "dy_28672": {"loops4k_w8": loops(4096, 8),
                    "loops4k_w16": loops(4096, 16),
                    "one_read_w32": dict(max_single=1 << 16, num_warps=32)}}
MORE = {"x_4096": {"rows4_w8": dict(rows=4, num_warps=8), "rows8_w32": dict(rows=8, num_warps=32),
                   "rows2_w4": dict(rows=2, num_warps=4)},
        "x_14336": {"loops4k_w4": loops(4096, 4),
                    "one_read_w32": dict(max_single=1 << 16, num_warps=32)},
        "dy_4096": {"rows1_w16": dict(rows=1, num_warps=16), "rows2_w4": dict(rows=2, num_warps=4)},
        "dy_6144": {"w4": dict(num_warps=4), "loops4k_w8": loops(4096, 8)},
        "dy_28672": {"loops8k_w8": loops(8192, 8),
                     "loops16k_w32": loops(16384, 32)}}


def variants(name: str, which: str) -> dict:
    out = {"shipped": {}, "divide": dict(divide=True)}
    out.update(FEW[name])
    if which == "all":
        out.update(MORE[name])
    return out


def same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


def shape_rows(name: str, n: int, has_cs: bool, args, gpu: bool) -> dict:
    """{variant: {ms, tb_s, equal}} for one shape; ``equal``: q and scale bit for bit equal the torch path's
    (the divide variant: the share of q elements that differ, ``differ``)."""
    g = torch.Generator(device=args.device).manual_seed(n)
    x = (torch.randn(args.tokens, n, device=args.device, generator=g) * 3).to(torch.bfloat16)
    cs = torch.rand(n, device=args.device, generator=g) + 0.5 if has_cs else None
    ref = F.quantize_rows_torch(x, F.E4M3, cs)
    nbytes = x.numel() * 3 + x.shape[0] * 4
    out = {}
    for var, kw in variants(name, args.variants).items():
        def fn(kw=kw):
            return Q.quantize_rows_triton(x, F.E4M3, cs, F.EPS, **kw)
        got = fn()
        row = {"launch": list(Q.launch(n, has_cs, **{k: v for k, v in kw.items() if k != "divide"}))}
        if gpu:
            row["ms"] = median_ms(fn, warmup=args.warmup, iters=args.iters)
            row["tb_s"] = nbytes / row["ms"] / 1e9
            row["equal"] = same(got, ref)
            row["differ"] = float((got[0].view(torch.uint8) != ref[0].view(torch.uint8)).float().mean())
        out[var] = row
        del got
    if gpu:  # the memory's pace here: a bf16 copy of x (2 bytes read and 2 written per element)
        ms = median_ms(lambda: torch.empty_like(x).copy_(x), warmup=args.warmup, iters=args.iters)
        out["_copy"] = {"ms": ms, "tb_s": x.numel() * 4 / ms / 1e9}
    return out


# the 8B's FP8 weights [out, in]: qkv, proj, fc1, fc2
WEIGHTS = (("qkv", 6144, 4096), ("proj", 4096, 4096), ("fc1", 28672, 4096), ("fc2", 4096, 14336))


def transpose_rows(args, gpu: bool) -> dict:
    """{weight: {ms, tb_s, equal}} of the input gradient's W_q operand (column-major W_q, made per
    backward); on a CPU the shapes over 64."""
    out = {}
    div = 1 if gpu else 64
    for name, n, k in WEIGHTS:
        w = torch.randint(0, 256, (n // div, k // div), dtype=torch.uint8, device=args.device).view(F.E4M3)
        got = Q.transposed_operand(w)
        row = {"equal": bool(torch.equal(got.view(torch.uint8), w.view(torch.uint8)))}
        if gpu:
            row["ms"] = median_ms(lambda w=w: Q.transposed_operand(w), warmup=args.warmup, iters=args.iters)
            row["tb_s"] = 2 * w.numel() / row["ms"] / 1e9
        out[name] = row
    return out


def layer_ms(res: dict) -> dict:
    """Per-layer sums (calls per shape in SHAPES) of the divide, shipped and fastest launches."""
    tot = {"divide": 0.0, "shipped": 0.0, "best": 0.0}
    best = {}
    for name, _, _, calls in SHAPES:
        rows = {k: v for k, v in res[name].items() if not k.startswith("_") and k != "divide"}
        exact = {k: v for k, v in rows.items() if v["equal"]}  # a launch that is not exact is never picked
        pick = min(exact or rows, key=lambda k: rows[k]["ms"])
        best[name] = pick
        tot["divide"] += calls * res[name]["divide"]["ms"]
        tot["shipped"] += calls * res[name]["shipped"]["ms"]
        tot["best"] += calls * rows[pick]["ms"]
    return {"ms": tot, "best_launch": best,
            "shipped_vs_divide": tot["divide"] / tot["shipped"] if tot["shipped"] else math.nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--tokens", type=int, default=32768 if gpu else 4)
    ap.add_argument("--variants", choices=("few", "all"), default="few")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma list of SHAPES names")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.device = "cuda" if gpu else "cpu"
    res = {"tokens": args.tokens, "variants": args.variants}
    for name, n, has_cs, _ in SHAPES:
        if name in args.shapes.split(","):
            res[name] = shape_rows(name, n, has_cs, args, gpu)
            if gpu:
                print(name, {k: round(v["ms"], 4) for k, v in res[name].items()}, flush=True)
    res["transpose"] = transpose_rows(args, gpu)
    if gpu and all(s[0] in res for s in SHAPES):
        res["layer"] = layer_ms(res)
        res["all_equal"] = all(v.get("equal", True) for s in SHAPES for k, v in res[s[0]].items()
                               if k not in ("divide", "_copy"))
    write_json({**run_info(), "fp8_quant": res}, args.out)


if __name__ == "__main__":
    main()
