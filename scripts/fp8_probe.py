"""FP8 frozen base on one GPU: where the host time goes, and what drives the LoRA-gradient error (issue 23).

    python scripts/fp8_probe.py --out fp8_probe.json [--mb-tokens 6144] [--skip-host] [--skip-model]

``host``: one LoRA linear (qkv shape, 4 adapters r=16) at a few rows, where the GPU work is short, so the time per
    call is the host's: per call, the host time to enqueue (no sync) and the wall time with the GPU, for the bf16
    one op, the FP8 one op, and the FP8 pieces (X quantization, W_q transpose, scaled GEMM, torch.mm).
``model``: the 8B model (random bf16 base, ``check_fp8.build_8b``), one packed microbatch of ``--mb-tokens``
    tokens over the 4 adapters, two token sets: uniform over the vocabulary (check_fp8's) and Zipf-distributed
    (p(rank r) ∝ 1/r^1.1 over a random permutation of the vocabulary: the unigram shape of text). The bf16
    base's LoRA gradients are the reference (and the bf16 step run twice: the run-to-run floor). Then the base is
    quantized in steps, keeping the first 4, 2, 1, 0 decoder layers in bf16 (``quantize_base(bf16_layers=...)``),
    and the cosine of every LoRA gradient with the reference is taken at each; at 0 also per layer, with dY in
    e5m2, and with the forward GEMM's fast accumulation where K = 4096
    (qkv, proj, fc1). Per precision: forward+backward ms (CUDA events, median
    of 3), synchronizing CUDA calls in one step (``torch.cuda.set_sync_debug_mode``), and the top host ops of one
    step under ``torch.profiler`` (CPU and CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import check_fp8 as C  # noqa: E402
from lorafusion.ops import fp8_linear as F  # noqa: E402


def host_ms(fn, n: int = 40) -> dict:
    """Host ms per call to enqueue ``fn`` (no sync in the loop) and wall ms per call with the GPU."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"host_ms": (t1 - t0) * 1e3 / n, "wall_ms": (t2 - t0) * 1e3 / n}


def host_probe(m: int = 256, k: int = 4096, n: int = 6144) -> dict:
    from lorafusion.core.routing import Routing
    from lorafusion.ops.fp8_lora import fp8_multi_lora_linear
    from lorafusion.ops.fused import multi_lora_linear_fused
    from lorafusion.ops.tables import TableCache

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    q, s = F.quantize_weight(w)
    A = [(torch.randn(16, k, device="cuda", generator=g) * 0.01).requires_grad_(True) for _ in range(4)]
    B = [(torch.randn(n, 16, device="cuda", generator=g) * 0.01).requires_grad_(True) for _ in range(4)]
    cut = [0, m // 4, m // 2, 3 * m // 4, m]
    routing = Routing(segments=tuple((a, cut[a], cut[a + 1] - cut[a]) for a in range(4)), num_rows=m)
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    lo = ([2.0] * 4, [0.1] * 4, [11, 12, 13, 14], routing)
    cache = TableCache()
    seed_table = torch.tensor([11, 12, 13, 14], device="cuda")
    xq, sx = F.quantize_rows(x.detach())
    xd = x.detach()
    fns = {
        "bf16_one_op_fwd_bwd": lambda: multi_lora_linear_fused(x, w, None, A, B, *lo, cache=cache,
                                                               seed_table=seed_table).backward(dy),
        "fp8_one_op_fwd_bwd": lambda: fp8_multi_lora_linear(x, q, s, None, A, B, *lo, cache=cache,
                                                            seed_table=seed_table).backward(dy),
        "bf16_one_op_fwd": lambda: multi_lora_linear_fused(xd, w, None, A, B, *lo, cache=cache, seed_table=seed_table),
        "fp8_one_op_fwd": lambda: fp8_multi_lora_linear(xd, q, s, None, A, B, *lo, cache=cache, seed_table=seed_table),
        "quantize_rows": lambda: F.quantize_rows(xd),
        "quantize_rows_dy_colscale": lambda: F.quantize_rows(dy, F.E4M3, s),
        "transpose": lambda: F.transpose(q),
        "scaled_gemm": lambda: F.scaled_gemm(xq, sx, q, s.view(1, -1), torch.bfloat16),
        "fp8_matmul": lambda: F.fp8_matmul(xd, q, s),
        "fp8_input_grad": lambda: F.fp8_input_grad(dy, q, s, F.E4M3),
        "torch_mm": lambda: xd @ w.t(),
        "empty_like": lambda: torch.empty_like(xd),
    }
    return {"m": m, "k": k, "n": n, **{key: host_ms(fn) for key, fn in fns.items()}}


def zipf_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    perm = torch.randperm(vocab, generator=gen)
    return perm[torch.multinomial(p, n, replacement=True, generator=gen)].tolist()


def batch_of(names, mb_tokens: int, draw) -> object:
    from lorafusion.data import pack_microbatch

    parts = [int(mb_tokens * f) for f in (0.3, 0.15, 0.35)]
    parts.append(mb_tokens - sum(parts))
    return pack_microbatch([(nm, draw(t)) for nm, t in zip(names, parts)], row_ids=list(range(4))).to(torch.device(C.DEV))


def cosines(grads, ref) -> dict:
    cos = C.grad_cosines(grads, ref)
    vals = sorted(cos.values())
    num = sum(float((grads[k].double() - ref[k].double()).norm() ** 2) for k in ref)
    den = sum(float(ref[k].double().norm() ** 2) for k in ref)
    return {"median": statistics.median(vals), "min": vals[0], "p10": vals[len(vals) // 10],
            "below_0.99": sum(v < 0.99 for v in vals), "tensors": len(vals), "grad_rel_err_all": (num / den) ** 0.5,
            "_per_tensor": cos}


def by_layer(cos: dict) -> dict:
    out: dict = {}
    for key, v in cos.items():
        out.setdefault(int(key.split(".")[0]), []).append(v)
    return {layer: round(statistics.median(v), 4) for layer, v in sorted(out.items())}


def step_nosync(model, batch, names):
    """Forward + backward of the summed adapter losses, nothing read back to the host."""
    from lorafusion.layers import lora_batch

    model.zero_grad(set_to_none=True)
    with lora_batch(model, batch.routing, batch.adapters, [11 + i for i in range(len(batch.adapters))]):
        per_token = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                          packed_seq_params=batch.packed_seq_params())
    (per_token.float() * batch.loss_mask).sum().backward()


def count_syncs(model, batch, names) -> dict:
    if C.DEV != "cuda":
        return {}
    step_nosync(model, batch, names)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_nosync(model, batch, names)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]
    return {"syncs": len(msgs), "first": sorted(set(msgs))[:8]}


def cpu_profile(model, batch, names, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    if C.DEV != "cuda":
        return {}
    step_nosync(model, batch, names)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step_nosync(model, batch, names)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {"host_enqueue_ms": (t1 - t0) * 1e3, "wall_ms": (t2 - t0) * 1e3,
            "top_self_cpu": [[e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 2),
                              round(e.cpu_time_total / 1e3, 2)] for e in ev]}


def timed(model, batch, names) -> dict:
    if C.DEV != "cuda":
        return {}
    step_nosync(model, batch, names)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step_nosync(model, batch, names)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"ms_fwd_bwd": C.cuda_ms(lambda: step_nosync(model, batch, names), iters=3, warm=1),
            "host_enqueue_ms": (t1 - t0) * 1e3, "wall_ms": (t2 - t0) * 1e3}


def model_probe(mb_tokens: int, out: dict, path: Path) -> None:
    from lorafusion.layers.fp8_base import quantize_base
    from lorafusion.ops import fp8_lora

    model, names = C.build_8b(arch="llama3.1-8b" if C.DEV == "cuda" else "tiny-llama")
    g = torch.Generator().manual_seed(5)
    vocab = 128000 if C.DEV == "cuda" else 500
    batches = {"uniform": batch_of(names, mb_tokens, lambda t: torch.randint(0, vocab, (t,), generator=g).tolist()),
               "zipf": batch_of(names, mb_tokens, lambda t: zipf_tokens(t, vocab, g))}
    ref = {key: C.step(model, b, names) for key, b in batches.items()}
    res = {"losses_bf16": {key: r[0] for key, r in ref.items()}}
    again = C.step(model, batches["uniform"], names)
    res["bf16_rerun"] = {k: v for k, v in cosines(again[1], ref["uniform"][1]).items() if k[0] != "_"}
    res["bf16"] = {**timed(model, batches["uniform"], names), **count_syncs(model, batches["uniform"], names),
                   "profile": cpu_profile(model, batches["uniform"], names)}
    out["model"] = res
    path.write_text(json.dumps(out, indent=1))
    for keep in (4, 2, 1, 0):
        quantize_base(model, "fp8", bf16_layers=keep)
        for key in (("uniform", "zipf") if keep in (1, 0) else ("uniform",)):
            l8, g8 = C.step(model, batches[key], names)
            c = cosines(g8, ref[key][1])
            row = {k: v for k, v in c.items() if k[0] != "_"}
            row["losses"] = l8
            if keep == 0 and key == "uniform":
                row["by_layer_median"] = by_layer(c["_per_tensor"])
            res[f"fp8_keep{keep}_{key}"] = row
            print(f"keep={keep} {key}", json.dumps({k: v for k, v in row.items() if k != "by_layer_median"}),
                  flush=True)
        path.write_text(json.dumps(out, indent=1))
    res["fp8"] = {**timed(model, batches["uniform"], names), **count_syncs(model, batches["uniform"], names),
                  "profile": cpu_profile(model, batches["uniform"], names)}
    path.write_text(json.dumps(out, indent=1))
    for name, patch in (("dy_e5m2", lambda on: setattr(F, "GRAD_DTYPE", F.E5M2 if on else F.E4M3)),
                        ("fwd_fast_accum_k4096", lambda on: setattr(F, "FWD_FAST_ACCUM_MAX_K", 8192 if on else 0))):
        patch(True)
        try:
            c = cosines(C.step(model, batches["uniform"], names)[1], ref["uniform"][1])
            res[f"fp8_keep0_uniform_{name}"] = {**{k: v for k, v in c.items() if k[0] != "_"},
                                                **({"ms_fwd_bwd": timed(model, batches["uniform"], names).get("ms_fwd_bwd")}
                                                   if name.startswith("fwd_fast") else {})}
        finally:
            patch(False)
        print(name, json.dumps(res[f"fp8_keep0_uniform_{name}"]), flush=True)
    assert fp8_lora.F is F
    path.write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_probe.json")
    ap.add_argument("--mb-tokens", type=int, default=6144)
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, no host probe: checks the script")
    args = ap.parse_args()
    path = Path(args.out)
    if args.smoke:
        C.DEV = "cpu"
    out: dict = {"device": torch.cuda.get_device_name() if C.DEV == "cuda" else "cpu", "torch": torch.__version__}
    if not args.skip_host and C.DEV == "cuda":
        out["host"] = {f"m{m}": host_probe(m) for m in (256,)}
        print("host", json.dumps(out["host"]), flush=True)
        path.write_text(json.dumps(out, indent=1))
    if not args.skip_model:
        model_probe(args.mb_tokens, out, path)


if __name__ == "__main__":
    main()
