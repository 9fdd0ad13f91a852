"""Packed (varlen) causal attention on the 8B's shapes: each implementation of ``model.attention``'s forward
and forward+backward time, its error against the fp32 reference and what it keeps for the backward.

    python scripts/bench_attention.py --out $OUT/attention-h100.json        # on a GPU (~1 minute)
    python scripts/bench_attention.py --dry-run --out /tmp/attention.json   # CPU: tiny shapes, the flow only

Shapes: 32 query heads, 8 kv heads, head dim 128, bf16 — Llama-3.1-8B's attention layer. Packed microbatches
of the bench data's length mix (``lorafusion.core.lengths``: the four profiles of the shipped 8B config's
jobs, in turn, plus bos and eos) filled up to a capacity (11,776 and 13,312: the shipped config's bf16 and
fp8 ``auto`` picks on an H100; 4,096), and one sample of 4,096 tokens. Candidates: ``fa4``
(FlashAttention-4, lorafusion.models.attention.fa4_attention, grouped k and v), ``fa2`` (torch's varlen_attn
as training runs it: k and v expanded to the query heads where torch has no ``enable_gqa``); one that does
not import or run here is recorded with its error.

Per candidate and shape: the first call's seconds (FlashAttention-4 compiles its kernels then), the median of
``--iters`` CUDA-event timings after ``--warmup`` calls of the forward and of forward+backward, the causal
FLOP rate, the peak memory above the inputs; at the error shapes the largest absolute and relative (norm)
error of the output and of dq, dk, dv against the fp32 per-sample SDPA reference; the bytes per token the
call keeps for the backward (saved-tensor hooks, each storage once, with q and k new tensors and v a view of
a qkv tensor as in the model) beside the memory model's count (scheduler.memory.attention_elems). ``order``
ranks the candidates that ran correctly by forward+backward time at the first capacity: the order
``AUTO_ORDER`` in lorafusion/models/attention.py should hold for this GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _bench import median_ms, run_info, write_json  # noqa: E402

from lorafusion.core.lengths import LENGTH_PROFILES, profile_lengths  # noqa: E402
from lorafusion.models import attention as att  # noqa: E402

CANDIDATES = {"fa4": att.fa4_attention, "fa2": att.fa2_attention}
GPU_SHAPE = dict(heads=32, groups=8, head_dim=128)
GPU_SHAPES = [("mix11776", 11776), ("mix13312", 13312), ("mix4096", 4096), ("one4096", None)]
CPU_SHAPE = dict(heads=4, groups=2, head_dim=16)
CPU_SHAPES = [("mix96", 96), ("one40", None)]


def packed_lengths(capacity: int | None, seed: int = 0, longest: int = 4096) -> list[int]:
    """Sample lengths (tokens: characters + bos + eos) of one packed microbatch: the four profiles in turn,
    each next sample appended while it fits the capacity (None: one sample of ``longest``)."""
    if capacity is None:
        return [longest]
    rng = np.random.default_rng(seed)
    names, out = list(LENGTH_PROFILES), []
    for i in range(10_000):
        n = int(profile_lengths(names[i % len(names)], 1, rng, longest)[0]) + 2
        if sum(out) + n > capacity:
            if capacity - sum(out) < 64 or i > 200:
                break
            continue
        out.append(n)
    return out


def _inputs(lengths, heads, groups, head_dim, dtype, device, seed=0):
    """q, k new tensors and v a view of a [T, groups, (heads/groups + 2)·D] qkv leaf, as Megatron splits it;
    cu_seqlens (int32) and an output gradient."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t, r = sum(lengths), heads // groups
    qkv = torch.randn(t, groups, (r + 2) * head_dim, generator=gen).to(device=device, dtype=dtype)
    qkv.requires_grad_(True)
    q = qkv[..., :r * head_dim].reshape(t, heads, head_dim) * 1.0
    k = qkv[..., r * head_dim:(r + 1) * head_dim] * 1.0
    v = qkv[..., (r + 1) * head_dim:]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    dout = torch.randn(t, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return qkv, q, k, v, cu, dout


def saved_elems_per_token(fn, lengths, shape, dtype, device) -> float:
    """Bytes per token (in 2-byte elements) of the storages ``fn`` keeps for its backward, each once."""
    qkv, q, k, v, cu, _ = _inputs(lengths, **shape, dtype=dtype, device=device)
    seen: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(q, k, v, cu)
    seen.pop(cu.untyped_storage().data_ptr(), None)  # cu_seqlens: per microbatch, not per token
    del out
    return sum(seen.values()) / 2 / sum(lengths)


def _errors(got, want) -> dict:
    out = {}
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        x, y = x.float(), y.float()
        out[name] = {"max_abs": (x - y).abs().max().item(), "max_abs_ref": y.abs().max().item(),
                     "rel_norm": ((x - y).norm() / y.norm().clamp_min(1e-30)).item()}
    return out


def _grads(fn, q, k, v, cu, dout):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves, cu)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def causal_flops(lengths, heads, head_dim) -> float:
    """Forward FLOPs of causal attention: QKᵀ and PV over the lower triangle (2·2·L²/2·D per head)."""
    return 2.0 * heads * head_dim * sum(n * n for n in lengths)


def time_candidate(fn, lengths, shape, dtype, device, warmup, iters) -> dict:
    _, q, k, v, cu, dout = _inputs(lengths, **shape, dtype=dtype, device=device)
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    t0 = time.perf_counter()
    fn(q, k, v, cu).backward(dout)  # the first call: FlashAttention-4 compiles here
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0

    def fwd():
        with torch.no_grad():
            fn(q, k, v, cu)

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v, cu).backward(dout)

    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    f_ms = median_ms(fwd, warmup, iters)
    fb_ms = median_ms(fwd_bwd, warmup, iters)
    flops = causal_flops(lengths, shape["heads"], shape["head_dim"])
    rec = {"first_call_s": round(first_s, 3), "fwd_ms": round(f_ms, 4), "fwd_bwd_ms": round(fb_ms, 4),
           "bwd_ms": round(fb_ms - f_ms, 4), "fwd_tflops": round(flops / f_ms / 1e9, 1),
           "fwd_bwd_tflops": round(3.5 * flops / fb_ms / 1e9, 1)}
    if device.type == "cuda":
        rec["peak_above_inputs_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return rec


def run_shape(name, cap, shape, dtype, device, args, check: bool) -> dict:
    lengths = packed_lengths(cap, seed=args.seed, longest=args.longest)
    rec = {"capacity": cap, "samples": len(lengths), "tokens": sum(lengths),
           "longest": max(lengths),
           "sum_sq_over_tokens": round(sum(n * n for n in lengths) / sum(lengths), 1),
           "candidates": {}}
    scale = 1 / math.sqrt(shape["head_dim"])
    if check:  # the fp32 reference once per shape
        _, q, k, v, cu, dout = _inputs(lengths, **shape, dtype=dtype, device=device)
        want = _grads(lambda a, b, c, cu_: att.varlen_attention_reference(a, b, c, cu_.cpu(), scale),
                      *(x.float() for x in (q, k, v)), cu, dout.float())
    for cand in args.candidates:
        def fn(a, b, c, cu_, f=CANDIDATES[cand]):
            return f(a, b, c, cu_, max(lengths), scale)

        try:
            r = time_candidate(fn, lengths, shape, dtype, device, args.warmup, args.iters)
            if check:
                r["error_vs_fp32"] = _errors(_grads(fn, q, k, v, cu, dout), want)
                r["saved_elems_per_token"] = round(saved_elems_per_token(fn, lengths, shape, dtype, device),
                                                   1)
        except Exception as e:  # not installed / no kernel here: recorded, the others still run
            r = {"error": f"{type(e).__name__}: {str(e).strip()[:400]}"}
        rec["candidates"][cand] = r
        print(f"{name} {cand}: {r}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def memory_model_counts(shape) -> dict:
    """The memory model's attention elements per token per path ({} where the scheduler's dependencies are
    not installed: a run with Megatron alone, scripts/device/fa4_install.sh)."""
    from dataclasses import replace

    try:
        from lorafusion.core.arch import preset
        from lorafusion.scheduler.memory import ATTENTION_PATHS, AdapterShape, MemorySetup, attention_elems
    except ImportError:
        return {}

    arch = preset("llama3.1-8b")
    if (arch.num_attention_heads, arch.num_query_groups, arch.kv_channels) != tuple(shape.values()):
        return {}
    s = MemorySetup(arch, (AdapterShape(16),))
    return {p: attention_elems(replace(s, attention=p)) for p in ATTENTION_PATHS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the JSON record")
    ap.add_argument("--candidates", default="fa2,fa4")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--longest", type=int, default=4096)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the reference as the candidate")
    args = ap.parse_args()
    args.candidates = [c for c in args.candidates.split(",") if c]
    if args.iters < 6:
        raise SystemExit("--iters: at least 6 timed calls for a median")
    if args.dry_run:
        CANDIDATES["per-sample"] = lambda q, k, v, cu, m, s: att.varlen_attention_reference(q, k, v, cu, s)
        args.candidates, args.longest, args.warmup, args.iters = ["per-sample"], 40, 1, 6
        device, dtype, shape, shapes = torch.device("cpu"), torch.float32, CPU_SHAPE, CPU_SHAPES
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --dry-run)")
        device, dtype, shape, shapes = torch.device("cuda"), torch.bfloat16, GPU_SHAPE, GPU_SHAPES
    rec = {**run_info(), "torch": torch.__version__, "versions": _versions(), "shape": shape,
           "dtype": str(dtype), "warmup": args.warmup, "iters": args.iters, "shapes": {},
           "memory_model_elems_per_token": memory_model_counts(shape)}
    for i, (name, cap) in enumerate(shapes):
        rec["shapes"][name] = run_shape(name, cap, shape, dtype, device, args, check=i == 0 or cap is None)
        if args.out:  # a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")
    first = rec["shapes"][shapes[0][0]]["candidates"]
    ok = {c: r["fwd_bwd_ms"] for c, r in first.items() if "fwd_bwd_ms" in r
          and max(e["rel_norm"] for e in r["error_vs_fp32"].values()) <= att.PROBE_TOLERANCE}
    rec["order"] = sorted(ok, key=ok.get)
    rec["speedup_fwd_bwd_vs_fa2"] = {c: round(first["fa2"]["fwd_bwd_ms"] / ms, 3) for c, ms in ok.items()
                                     if "fwd_bwd_ms" in first.get("fa2", {})}
    write_json(rec, args.out)


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


if __name__ == "__main__":
    main()
