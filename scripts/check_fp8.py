"""FP8 frozen base on one GPU, LLaMA-3.1-8B shapes: quality and GEMM speed, one JSON.

    python scripts/check_fp8.py --out fp8_quality.json [--tokens 12288] [--mb-tokens 6144]

(a) ``layers``: per decoder linear (qkv, proj, fc1, fc2) at ``--tokens`` rows: relative error (Frobenius) of
    Y = X·Wᵀ and dX = dY·W against a float32 GEMM (TF32 off), bf16 and FP8 (dY in e4m3 and in e5m2), Gaussian
    X and dY, W ~ N(0, 0.02); times (CUDA events, median of 10 after 3 warm-up): bf16 GEMM, FP8 with the row
    quantization (and without), fast accumulation on, and the dX path (quantize dY, transpose W_q, GEMM).
(b) ``model``: the 8B model (random bf16 base, 4 adapters r=16 all-linear, dropout 0.1, B drawn N(0, 0.01) so
    that every A gets a gradient), one packed microbatch of ``--mb-tokens`` tokens over the 4 adapters: every
    LoRA gradient with the bf16 base, then the same model quantized in place (model.base_precision: fp8) on
    the same microbatch (same dropout masks): cosine similarity per tensor, losses, base-weight bytes and
    allocated memory before / after, and forward+backward time of the microbatch (median of 3) for both;
    ``profile``: one step of each under torch.profiler, GPU kernel time by kind (GEMM, FP8 quantization, W_q
    transpose, LoRA kernels, attention, other) against the step's wall time.
(c) ``lora_linear``: per linear, 4 adapters r=16 over the rows, forward+backward of base + LoRA (CUDA events,
    median): bf16 one op (the fused kernels, cuBLAS), FP8 split (fp8_linear + the LoRA term, added by
    autograd: the path before the one-op FP8 linear), FP8 one op (lorafusion.ops.fp8_lora).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import median_ms, run_info  # noqa: E402
from lorafusion.ops import fp8_linear as F  # noqa: E402

DEV = "cuda"  # --smoke: "cpu", shapes / 64 and the tiny preset (a check of this script, no numbers)
SHAPES = {"linear_qkv": (4096, 6144), "linear_proj": (4096, 4096), "linear_fc1": (4096, 28672),
          "linear_fc2": (14336, 4096)}  # (in k, out n), TP = 1


def cuda_ms(fn, iters: int = 10, warm: int = 3) -> float:
    """Median ms on the GPU (a ``--smoke`` run on the CPU calls ``fn`` once and reports no time)."""
    if DEV == "cpu":
        fn()
        return float("nan")
    return median_ms(fn, warmup=warm, iters=iters)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def fp8_dx(x, q, s, dy, grad_dtype):
    xr = x.detach().requires_grad_(True)
    F.fp8_linear(xr, q, s, grad_dtype=grad_dtype).backward(dy)
    return xr.grad


def layer_row(m: int, k: int, n: int) -> dict:
    g = torch.Generator(device=DEV).manual_seed(k * 7 + n)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    dy = torch.randn(m, n, device=DEV, generator=g).to(torch.bfloat16)
    q, s = F.quantize_weight(w)
    row: dict = {"m": m, "k": k, "n": n}
    with torch.no_grad():
        ref = x.float() @ w.float().t()
        row["y_rel_err_bf16"] = rel(x @ w.t(), ref)
        row["y_rel_err_fp8"] = rel(F.fp8_linear(x, q, s), ref)
        xq_, sx_ = F.quantize_rows(x)
        row["y_rel_err_fp8_fast_accum"] = rel(
            F.scaled_gemm(xq_, sx_, q, s.view(1, -1), torch.bfloat16, True), ref)
        del ref
        dref = dy.float() @ w.float()
        row["dx_rel_err_bf16"] = rel(dy @ w, dref)
    for name, dt in (("e4m3", F.E4M3), ("e5m2", F.E5M2)):
        row[f"dx_rel_err_fp8_{name}"] = rel(fp8_dx(x, q, s, dy, dt), dref)
    del dref
    with torch.no_grad():
        x_q, s_x = F.quantize_rows(x)
        ones = torch.ones(1, k, device=DEV)
        t = {"fwd_bf16": lambda: x @ w.t(), "fwd_fp8": lambda: F.fp8_linear(x, q, s),
             "fwd_fp8_gemm_only": lambda: F.scaled_gemm(x_q, s_x, q, s.view(1, -1), torch.bfloat16),
             "fwd_fp8_gemm_fast_accum": lambda: F.scaled_gemm(x_q, s_x, q, s.view(1, -1),
                                                              torch.bfloat16, True),
             "quant_x": lambda: F.quantize_rows(x),
             "dgrad_bf16": lambda: dy @ w,
             "dgrad_fp8": lambda: F.Fp8BaseLinear.backward(_Ctx(q, s), dy),
             "transpose_wq": lambda: F.transpose(q), "transpose_wq_torch": lambda: q.t().contiguous(),
             "quant_dy": lambda: F.quantize_rows(dy, F.E4M3, s)}
        g_q, s_g = F.quantize_rows(dy, F.E4M3, s)
        w_t = q.t().contiguous()
        t["dgrad_fp8_gemm_only"] = lambda: F.scaled_gemm(g_q, s_g, w_t, ones, torch.bfloat16)
        for key, fn in t.items():
            row[f"ms_{key}"] = cuda_ms(fn)
    flops = 2 * m * k * n
    row["tflops_fwd_bf16"] = flops / row["ms_fwd_bf16"] / 1e9
    row["tflops_fwd_fp8_gemm_only"] = flops / row["ms_fwd_fp8_gemm_only"] / 1e9
    row["speedup_fwd"] = row["ms_fwd_bf16"] / row["ms_fwd_fp8"]
    row["speedup_dgrad"] = row["ms_dgrad_bf16"] / row["ms_dgrad_fp8"]
    return row


class _Ctx:  # what Fp8BaseLinear.backward reads from its ctx
    def __init__(self, q, s):
        self.w = F.Fp8Weight(q, s)
        self.needs_input_grad = (True, False, False)
        self.grad_dtype = F.GRAD_DTYPE


def build_8b(seed: int = 1234, arch: str = "llama3.1-8b", base_precision: str = "bf16"):
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.layers import add_adapter, lora_modules
    from lorafusion.models.provider import build_model
    from lorafusion.dist import init_distributed

    init_distributed(1, 1, seed=seed)
    model = build_model(preset(arch), params_dtype=torch.bfloat16, device=torch.device(DEV), seed=seed,
                        base_precision=base_precision)
    spec = LoRASpec(r=16, lora_alpha=32, lora_dropout=0.1, target_modules=("all-linear",))
    names = [f"job{i}" for i in range(4)]
    for name in names:
        add_adapter(model, name, spec, seed=seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for n in sorted(mod.lora_B):
                mod.lora_B[n].copy_(torch.randn(mod.lora_B[n].shape, device=DEV, generator=gen) * 0.01)
    return model.train(), names


def step(model, batch, names, dtype: torch.dtype = torch.float32):
    """Loss per adapter and every LoRA gradient (in ``dtype``) for one packed microbatch."""
    from lorafusion.layers import lora_batch, lora_modules

    model.zero_grad(set_to_none=True)
    with lora_batch(model, batch.routing, batch.adapters, [11 + i for i in range(len(batch.adapters))]):
        per_token = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                          packed_seq_params=batch.packed_seq_params())
    losses = {}
    for n in names:
        msk = batch.adapter_token_mask(n).to(dtype) * batch.loss_mask.to(dtype)
        losses[n] = (per_token.to(dtype) * msk).sum() / msk.sum()
    sum(losses.values()).backward()
    grads = {f"{key}.{p}.{n}": getattr(mod, p)[n].grad.detach().to(dtype).clone()
             for key, mod in lora_modules(model) for p in ("lora_A", "lora_B") for n in getattr(mod, p)}
    return {n: v.item() for n, v in losses.items()}, grads


def grad_cosines(grads: dict, ref: dict) -> dict:
    """Each LoRA gradient's cosine similarity with its reference (float64), by name."""
    return {k: float(torch.nn.functional.cosine_similarity(grads[k].flatten().double(),
                                                           ref[k].flatten().double(), dim=0))
            for k in ref}


def model_check(mb_tokens: int) -> dict:
    from lorafusion.data import pack_microbatch
    from lorafusion.layers.inject import base_weight_bytes

    arch = "tiny-llama" if DEV == "cpu" else "llama3.1-8b"
    model, names = build_8b(arch=arch)
    g = torch.Generator().manual_seed(5)
    parts = [int(mb_tokens * f) for f in (0.3, 0.15, 0.35)]
    parts.append(mb_tokens - sum(parts))
    samples = [(n, torch.randint(0, 500 if DEV == "cpu" else 128000, (t,), generator=g).tolist())
               for n, t in zip(names, parts)]
    batch = pack_microbatch(samples, row_ids=list(range(4))).to(torch.device(DEV))
    out: dict = {"mb_tokens": mb_tokens}
    res = {}
    for precision in ("bf16", "fp8"):
        if precision == "fp8":
            mem = (lambda: torch.cuda.memory_allocated() / 2 ** 30) if DEV == "cuda" else (lambda: 0.0)
            out["allocated_gib_before_quantize"] = mem()  # the bf16 model
            del model
            if DEV == "cuda":
                torch.cuda.empty_cache()
            model, names = build_8b(arch=arch, base_precision="fp8")  # same seeds: same base and adapters
            out["allocated_gib_after_quantize"] = mem()
        out[f"base_linear_weight_bytes_{precision}"] = base_weight_bytes(model)
        res[precision] = step(model, batch, names)
        out[f"ms_fwd_bwd_{precision}"] = cuda_ms(lambda: step(model, batch, names), iters=3, warm=1)
        out[f"losses_{precision}"] = res[precision][0]
        if DEV == "cuda":
            try:
                out[f"profile_{precision}"] = profile_step(model, batch, names)
            except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the measurements
                out[f"profile_{precision}"] = {"error": repr(e)}
    out["fwd_bwd_speedup"] = out["ms_fwd_bwd_bf16"] / out["ms_fwd_bwd_fp8"]
    g16, g8 = res["bf16"][1], res["fp8"][1]
    cos = grad_cosines(g8, g16)
    vals = sorted(cos.values())
    out["grad_cosine"] = {"tensors": len(vals), "min": vals[0], "median": statistics.median(vals),
                          "p01": vals[len(vals) // 100], "below_0.99": sum(v < 0.99 for v in vals),
                          "worst": sorted(cos.items(), key=lambda kv: kv[1])[:8]}
    by_kind: dict = {}
    for k, v in cos.items():
        by_kind.setdefault(k.split(".")[1] + "." + k.split(".")[2], []).append(v)
    out["grad_cosine"]["min_by_kind"] = {k: min(v) for k, v in sorted(by_kind.items())}
    return out


def lora_linear_ms(m: int, k: int, n: int) -> dict:
    """Forward+backward ms of one LoRA linear (4 adapters r=16, dropout 0.1) with a bf16 / FP8 base."""
    from lorafusion.core.routing import Routing
    from lorafusion.ops.fp8_lora import fp8_multi_lora_linear
    from lorafusion.ops.fused import multi_lora_delta_fused, multi_lora_linear_fused
    from lorafusion.ops.tables import TableCache

    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    q, s = F.quantize_weight(w)
    A = [(torch.randn(16, k, device=DEV, generator=g) * 0.01).to(torch.bfloat16).requires_grad_(True)
         for _ in range(4)]
    B = [(torch.randn(n, 16, device=DEV, generator=g) * 0.01).to(torch.bfloat16).requires_grad_(True)
         for _ in range(4)]
    cut = [0, int(m * 0.3), int(m * 0.45), int(m * 0.8), m]
    routing = Routing(segments=tuple((a, cut[a], cut[a + 1] - cut[a]) for a in range(4)), num_rows=m)
    dy = torch.randn(m, n, device=DEV, generator=g).to(torch.bfloat16)
    lo = ([2.0] * 4, [0.1] * 4, [11, 12, 13, 14], routing)
    cache = TableCache()
    fns = {"bf16_one_op": lambda: multi_lora_linear_fused(x, w, None, A, B, *lo, cache=cache),
           "fp8_split": lambda: F.fp8_linear(x, q, s) + multi_lora_delta_fused(x, A, B, *lo, cache=cache),
           "fp8_one_op": lambda: fp8_multi_lora_linear(x, q, s, None, A, B, *lo, cache=cache)}
    out = {f"ms_fwd_bwd_{key}": cuda_ms(lambda fn=fn: fn().backward(dy)) for key, fn in fns.items()}
    out["one_op_saves_ms"] = out["ms_fwd_bwd_fp8_split"] - out["ms_fwd_bwd_fp8_one_op"]
    out["speedup_fp8_one_op_vs_bf16"] = out["ms_fwd_bwd_bf16_one_op"] / out["ms_fwd_bwd_fp8_one_op"]
    return out


def quant_variants(m: int) -> dict:
    """ms of the row quantization per launch variant: the long rows (fc1's dY with its column scale, fc2's X)
    as shipped (two loops over a row), one read from registers with 16 / 32 warps, two loops of 8k; the 4096-
    and 6144-column rows (X of qkv/proj/fc1, dY of qkv) as shipped (the 4096-column X: 4 rows a program, 16
    warps, since 2026-11-25; dY one row), or with other warps / rows a program. Equality is against one row a
    program."""
    if DEV != "cuda":
        return {}
    from lorafusion.kernels.fp8_quant import quantize_rows_triton

    g = torch.Generator(device=DEV).manual_seed(9)
    long_rows = (("shipped", {}), ("one_read_w16", {"max_single": 1 << 16, "num_warps": 16}),
                 ("one_read_w32", {"max_single": 1 << 16, "num_warps": 32}),
                 ("two_loops_8k_w16", {"block": 8192, "num_warps": 16}))
    short_rows = (("shipped", {}), ("w4", {"num_warps": 4}), ("w16", {"num_warps": 16}),
                  ("rows2_w8", {"rows": 2, "num_warps": 8}), ("rows2_w16", {"rows": 2, "num_warps": 16}),
                  ("rows4_w16", {"rows": 4, "num_warps": 16}), ("rows4_w32", {"rows": 4, "num_warps": 32}))
    out = {}
    for name, n, cs, variants in (("fc1_dy", 28672, True, long_rows), ("fc2_x", 14336, False, long_rows),
                                  ("qkv_x", 4096, False, short_rows), ("qkv_dy", 6144, True, short_rows)):
        x = torch.randn(m, n, device=DEV, generator=g).to(torch.bfloat16)
        c = torch.rand(n, device=DEV, generator=g) + 0.5 if cs else None
        q0, s0 = quantize_rows_triton(x, F.E4M3, c, F.EPS, rows=1)
        for var, kw in variants:
            out[f"{name}_{var}"] = cuda_ms(
                lambda x=x, c=c, kw=kw: quantize_rows_triton(x, F.E4M3, c, F.EPS, **kw))
            q1, s1 = quantize_rows_triton(x, F.E4M3, c, F.EPS, **kw)
            out[f"{name}_{var}_equal"] = bool(torch.equal(s0, s1) and torch.equal(q0.view(torch.uint8),
                                                                                  q1.view(torch.uint8)))
        del x
    return out


KINDS = (("quant", ("_quant_rows",)), ("transpose", ("_transpose_kernel",)),
         ("lora", ("_lora_gemm", "_shrink", "_ds_db", "_da_", "_da_kernel")),
         ("attention", ("flash", "fmha", "attn", "cudnn")),
         ("gemm", ("gemm", "cutlass", "nvjet", "sm90", "cublas", "xmma")))


def profile_step(model, batch, names) -> dict:
    """GPU kernel ms of one step by kind, and the step's wall ms (CPU-bound if the kernels add up to less)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(model, batch, names)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    by: dict = {}
    for ev in prof.key_averages():
        ms = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / 1e3
        if ms <= 0 or ev.key.startswith("cuda"):  # runtime calls (host side)
            continue
        kind = next((kd for kd, pats in KINDS if any(pt in ev.key for pt in pats)), "other")
        by[kind] = by.get(kind, 0.0) + ms
    return {"wall_ms_profiled": wall, "kernel_ms": sum(by.values()), "kernel_ms_by_kind": by}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_quality.json")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--mb-tokens", type=int, default=6144)
    ap.add_argument("--sections", default="layers,quant,lora,model", help="comma list of what to run")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes: checks the script runs")
    args = ap.parse_args()
    run = set(args.sections.split(",")) - ({"model"} if args.skip_model else set())
    if args.smoke:
        global DEV
        DEV = "cpu"
        for key, (k, n) in SHAPES.items():
            SHAPES[key] = (k // 64, n // 64)
    res = {**run_info(), "torch": torch.__version__,
           "tokens": args.tokens, "layers": {}}
    for name, (k, n) in SHAPES.items() if "layers" in run else ():
        res["layers"][name] = layer_row(args.tokens, k, n)
        print(name, json.dumps(res["layers"][name]), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=1))
    if "quant" in run:
        try:
            res["quant_variants_ms"] = quant_variants(args.tokens)
        except Exception as e:  # noqa: BLE001 - a variant that fails to launch must not lose the rest
            res["quant_variants_ms"] = {"error": repr(e)}
        print("quant_variants", json.dumps(res["quant_variants_ms"]), flush=True)
    res["lora_linear"] = {}
    for name, (k, n) in SHAPES.items() if "lora" in run else ():
        res["lora_linear"][name] = lora_linear_ms(args.tokens, k, n)
        print("lora_linear", name, json.dumps(res["lora_linear"][name]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    if "model" in run:
        res["model"] = model_check(args.mb_tokens)
        print("model", json.dumps(res["model"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
