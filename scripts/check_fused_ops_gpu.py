#!/usr/bin/env python
"""Check every fused model op (lorafusion.models.fused) in bf16 against a float64 reference at LLaMA-3.1-8B
shapes and time it against today's path, on one GPU.

Ops and the implementations compared (forward + backward, gradient w.r.t. the activation only; weights are
frozen as in LoRA training):
  linear_ce  output projection + per-token CE over 16,384 tokens × 128,256 vocab, random per-token
             grad_output, 10% ignored labels. triton / torch = chunked fused op (no logits kept);
             baseline = logits materialised + fp32 cross-entropy (what Megatron's GPTModel does).
  rms_norm   [tokens, 4096]. triton / torch = fused op, bf16 weight; baseline = torch.nn.RMSNorm with its
             fp32 weight on bf16 input (Megatron's WrappedTorchNorm today: the composite path).
  swiglu     fc1 output [tokens, 2·14336] → [tokens, 14336]. triton / torch = fused op; baseline =
             silu(gate) * up (Megatron's unfused glu).
  rope       packed q [tokens, 32, 128] and k [tokens, 8, 128] (samples of mixed lengths). triton / torch
             = sync-free packed RoPE (cos/sin built once, counted in the time); baseline = Megatron's
             _apply_rotary_pos_emb_thd (host syncs, per-sample split).
For each: relative error (Frobenius) of the output and the gradient vs float64, pass/fail at 2e-2; median
forward+backward time (CUDA events, warm-up first); peak memory above the inputs during one step; bytes
saved for backward per token. The last line printed is one JSON object with every number.

Runs with only torch, triton, liger-kernel and megatron-core importable (lorafusion is taken from this
checkout). ``--small`` runs tiny shapes (on CPU too, under TRITON_INTERPRET=1) as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _bench import median_ms, run_info  # noqa: E402
from lorafusion.models.fused.linear_cross_entropy import (  # noqa: E402
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lorafusion.models.fused.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from lorafusion.models.fused.rope import (  # noqa: E402
    packed_positions,
    packed_rope,
    rope_cos_sin,
    rope_reference,
)
from lorafusion.models.fused.swiglu import swiglu, swiglu_reference  # noqa: E402

TOL = 2e-2


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def finite(t) -> bool:
    return bool(torch.isfinite(t).all().item())


class Timer:
    def __init__(self, dev: torch.device, warmup: int, reps: int):
        self.dev, self.warmup, self.reps = dev, warmup, reps

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def median_ms(self, step) -> float:
        return median_ms(step, warmup=self.warmup, iters=self.reps)

    def peak_bytes(self, step) -> int | None:
        if self.dev.type != "cuda":
            return None
        self.sync()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        self.sync()
        return torch.cuda.max_memory_allocated() - base


def saved_bytes(fn, exclude=()) -> int:
    seen, total = {t.untyped_storage().data_ptr() for t in exclude}, [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total[0]


def measure(name, impls, make_step, make_forward, check, tokens, timer, exclude=()):
    """impls: {label: forward function of the activation}; check(label) → dict of errors."""
    res = {}
    for label, fwd in impls.items():
        r = {}
        try:
            r.update(check(label, fwd))
            step = make_step(fwd)
            r["ms"] = round(timer.median_ms(step), 4)
            pk = timer.peak_bytes(step)
            r["peak_mib"] = None if pk is None else round(pk / 2**20, 1)
            r["saved_bytes_per_token"] = round(saved_bytes(make_forward(fwd), exclude) / tokens, 1)
        except Exception as e:  # report, keep going with the other implementations
            r["error"] = f"{type(e).__name__}: {e}"[:300]
        res[label] = r
        print(f"{name:10s} {label:9s} " + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    return res


def sample_lengths(tokens: int, gen: torch.Generator) -> list[int]:
    out, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(16, 4096, (1,), generator=gen)))
        out.append(n)
        left -= n
    return out


class _CP:
    """Context-parallel group stand-in for Megatron's thd RoPE (size 1)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", default="linear_ce,rms_norm,swiglu,rope")
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes (smoke test; CPU with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.small:
        args.tokens, args.hidden, args.vocab, args.heads, args.kv_heads, args.head_dim, args.ffn = (
            96, 64, 1000, 4, 2, 16, 96)
        args.warmup, args.reps = 1, 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no CUDA: run with TRITON_INTERPRET=1 (and --small)")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    timer = Timer(dev, args.warmup, args.reps)
    gen = torch.Generator().manual_seed(0)
    T, H = args.tokens, args.hidden
    ops = set(args.ops.split(","))
    results: dict = {}

    def grad_step(fwd, x, dy):
        def step():
            x.grad = None
            fwd(x).backward(dy)
        return step

    if "linear_ce" in ops:
        hidden = (torch.randn(T, H, generator=gen)).to(dev, dt)
        weight = (torch.randn(args.vocab, H, generator=gen) / H**0.5).to(dev, dt)
        labels = torch.randint(0, args.vocab, (T,), generator=gen)
        labels[torch.rand(T, generator=gen) < 0.1] = -100
        labels = labels.to(dev)
        gout = (torch.rand(T, generator=gen) * 2).to(dev)
        # float64 reference, chunked over tokens (each token's loss depends on its row only)
        ref_loss = torch.empty(T, dtype=torch.float64, device=dev)
        ref_grad = torch.empty(T, H, dtype=torch.float64, device=dev)
        w64 = weight.double()
        for s in range(0, T, 2048):
            x = hidden[s:s + 2048].double().requires_grad_(True)
            lo = linear_cross_entropy_reference(x, w64, labels[s:s + 2048])
            (lo * gout[s:s + 2048].double()).sum().backward()
            ref_loss[s:s + 2048], ref_grad[s:s + 2048] = lo.detach(), x.grad
            del x, lo
        del w64

        # logits materialised, fp32 CE (Megatron: output_layer + vocab_parallel_cross_entropy)
        def baseline(x):
            logits = x @ weight.t()
            return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")

        impls = {"triton": lambda x: linear_cross_entropy(x, weight, labels, impl="triton"),
                 "torch": lambda x: linear_cross_entropy(x, weight, labels, impl="torch"),
                 "baseline": baseline}

        def check(label, fwd):
            x = hidden.clone().requires_grad_(True)
            lo = fwd(x)
            (lo * gout).sum().backward()
            e = {"loss_rel": rel(lo, ref_loss), "grad_rel": rel(x.grad, ref_grad)}
            e["ok"] = e["loss_rel"] <= TOL and e["grad_rel"] <= TOL and finite(lo) and finite(x.grad)
            return e

        def ce_step(fwd):
            x = hidden.clone().requires_grad_(True)

            def step():
                x.grad = None
                (fwd(x) * gout).sum().backward()
            return step

        results["linear_ce"] = measure(
            "linear_ce", impls, ce_step, lambda fwd: (lambda: fwd(hidden.clone().requires_grad_(True))),
            check, T, timer, exclude=(weight,))
        del hidden, weight, ref_grad, ref_loss
        torch.cuda.empty_cache() if dev.type == "cuda" else None

    if "rms_norm" in ops:
        x0 = (torch.randn(T, 1, H, generator=gen) * 2).to(dev, dt)
        w = (1 + 0.1 * torch.randn(H, generator=gen)).to(dev, dt)
        dy = torch.randn(T, 1, H, generator=gen).to(dev, dt)
        xr = x0.double().requires_grad_(True)
        ref = rms_norm_reference(xr, w.double(), 1e-5)
        ref.backward(dy.double())
        base_mod = torch.nn.RMSNorm(H, eps=1e-5).to(dev)  # fp32 weight, as WrappedTorchNorm builds it today
        with torch.no_grad():
            base_mod.weight.copy_(w.float())
        base_mod.weight.requires_grad_(False)
        impls = {"triton": lambda x: rms_norm(x, w, 1e-5, impl="triton"),
                 "torch": lambda x: rms_norm(x, w, 1e-5, impl="torch"), "baseline": base_mod}

        def check(label, fwd):
            x = x0.clone().requires_grad_(True)
            y = fwd(x)
            y.backward(dy.to(y.dtype))
            e = {"out_rel": rel(y, ref), "grad_rel": rel(x.grad, xr.grad), "out_dtype": str(y.dtype)}
            e["ok"] = e["out_rel"] <= TOL and e["grad_rel"] <= TOL and finite(y) and finite(x.grad)
            return e

        results["rms_norm"] = measure(
            "rms_norm", impls,
            lambda fwd: grad_step(lambda x: fwd(x).to(dt), x0.clone().requires_grad_(True), dy),
            lambda fwd: (lambda: fwd(x0.clone().requires_grad_(True))), check, T, timer,
            exclude=(w, base_mod.weight))
        del x0, dy, xr, ref

    if "swiglu" in ops:
        y0 = (torch.randn(T, 1, 2 * args.ffn, generator=gen) * 2).to(dev, dt)
        dout = torch.randn(T, 1, args.ffn, generator=gen).to(dev, dt)
        yr = y0.double().requires_grad_(True)
        ref = swiglu_reference(yr)
        ref.backward(dout.double())
        impls = {"triton": lambda y: swiglu(y, impl="triton"), "torch": lambda y: swiglu(y, impl="torch"),
                 "baseline": swiglu_reference}

        def check(label, fwd):
            y = y0.clone().requires_grad_(True)
            o = fwd(y)
            o.backward(dout)
            e = {"out_rel": rel(o, ref), "grad_rel": rel(y.grad, yr.grad)}
            e["ok"] = e["out_rel"] <= TOL and e["grad_rel"] <= TOL and finite(o) and finite(y.grad)
            return e

        results["swiglu"] = measure(
            "swiglu", impls, lambda fwd: grad_step(fwd, y0.clone().requires_grad_(True), dout),
            lambda fwd: (lambda: fwd(y0.clone().requires_grad_(True))), check, T, timer)
        del y0, dout, yr, ref

    if "rope" in ops:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

        lengths = sample_lengths(T, gen)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        D = args.head_dim
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        f = torch.outer(torch.arange(max(lengths), dtype=torch.float32), inv)
        freqs = torch.cat((f, f), -1)[:, None, None, :].to(dev)
        q0 = torch.randn(T, args.heads, D, generator=gen).to(dev, dt)
        k0 = torch.randn(T, args.kv_heads, D, generator=gen).to(dev, dt)
        dq = torch.randn(T, args.heads, D, generator=gen).to(dev, dt)
        dk = torch.randn(T, args.kv_heads, D, generator=gen).to(dev, dt)
        cos, sin = rope_cos_sin(freqs, packed_positions(cu, T))
        c64, s64 = cos.to(dt).double(), sin.to(dt).double()
        refs = []
        for t0, d in ((q0, dq), (k0, dk)):
            tr = t0.double().requires_grad_(True)
            r = rope_reference(tr, c64, s64)
            r.backward(d.double())
            refs.append((r.detach(), tr.grad))

        def fused(impl):
            def fwd(q, k):
                cu_mb = cu.clone()  # a fresh microbatch: cos/sin are built inside the timed step
                return packed_rope(q, freqs, cu_mb, impl=impl), packed_rope(k, freqs, cu_mb, impl=impl)
            return fwd

        def baseline(q, k):
            return (_apply_rotary_pos_emb_thd(q, cu, freqs, cp_group=_CP()),
                    _apply_rotary_pos_emb_thd(k, cu, freqs, cp_group=_CP()))

        impls = {"triton": fused("triton"), "torch": fused("torch"), "baseline": baseline}

        def check(label, fwd):
            q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
            oq, ok_ = fwd(q, k)
            torch.autograd.backward([oq, ok_], [dq, dk])
            e = {"q_rel": rel(oq, refs[0][0]), "k_rel": rel(ok_, refs[1][0]),
                 "dq_rel": rel(q.grad, refs[0][1]), "dk_rel": rel(k.grad, refs[1][1])}
            e["ok"] = max(e.values()) <= TOL and finite(oq) and finite(q.grad)
            if label == "torch":
                with torch.no_grad():
                    e["equals_megatron_bitwise"] = bool(torch.equal(oq, baseline(q0, k0)[0]))
            return e

        def rope_step(fwd):
            q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)

            def step():
                q.grad = k.grad = None
                oq, ok_ = fwd(q, k)
                torch.autograd.backward([oq, ok_], [dq, dk])
            return step

        results["rope"] = measure(
            "rope", impls, rope_step,
            lambda fwd: (lambda: fwd(q0.clone().requires_grad_(True), k0.clone().requires_grad_(True))),
            check, T, timer)
        results["rope"]["samples"] = len(lengths)

    all_ok = all(r.get("ok", False) for op in results.values() for k, r in op.items()
                 if isinstance(r, dict) and k != "baseline")
    summary = {
        **run_info(),
        "dtype": str(dt), "torch": torch.__version__, "shapes": {k: v for k, v in vars(args).items()},
        "all_fused_ok": all_ok, "tolerance": TOL, "ops": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
