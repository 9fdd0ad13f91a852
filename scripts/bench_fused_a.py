"""PEFT's A per projection vs one shared A on the fused linears (issue 25): forward + backward of the whole
LLaMA-3.1-8B-shaped model (32 layers, bf16, the layers' fused LoRA path as training runs it) on one packed
microbatch of ``--tokens`` tokens split over ``--adapters`` adapters (r, alpha 2r, dropout 0.1, all-linear),
routed once to adapters with an A per projection and once to the same number with a shared A, on the same model
and tokens, alternating. CUDA events, ``--warmup`` calls, median of ``--iters``. Prints a table, last line JSON.

    python3 scripts/bench_fused_a.py --tokens 12288 --out /tmp/fused_a.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch


def _step(model, batch, seeds):
    from lorafusion.layers import lora_batch

    with lora_batch(model, batch.routing, batch.adapters, seeds):
        loss = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                     packed_seq_params=batch.packed_seq_params())
    loss.float().sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--preset", default="llama3.1-8b", help="tiny-llama + a CPU: a smoke test of this script")
    ap.add_argument("--out")
    args = ap.parse_args()
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.data import pack_microbatch
    from lorafusion.dist import init_distributed
    from lorafusion.layers import adapter_parameters, add_adapter
    from lorafusion.models.provider import build_model

    init_distributed(1, 1)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    arch = preset(args.preset, num_layers=args.layers)
    model = build_model(arch, params_dtype=torch.bfloat16 if cuda else torch.float32, device=dev if cuda else None,
                        seed=0)
    variants = {"per_projection_a": False, "shared_a": True}
    gen = torch.Generator().manual_seed(0)
    n = args.tokens // args.adapters
    tokens = [torch.randint(0, arch.vocab_size, (n,), generator=gen).tolist() for _ in range(args.adapters)]
    batches, params = {}, {}
    for v, shared in variants.items():
        names = [f"{v}{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            add_adapter(model, name, LoRASpec(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.1,
                                              shared_fused_a=shared), seed=i)
            with torch.no_grad():
                for k, p in adapter_parameters(model, name).items():
                    if k.endswith("lora_B"):
                        p.normal_(0, 0.01, generator=None)
        params[v] = sum(p.numel() for name in names for p in adapter_parameters(model, name).values())
        batches[v] = pack_microbatch(list(zip(names, tokens, strict=True)), row_ids=list(range(args.adapters))).to(dev)
    model.train()
    seeds = list(range(args.adapters))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for it in range(args.warmup + args.iters):
        for v in variants:  # alternating: clocks and temperature drift hit both alike
            model.zero_grad(set_to_none=True)
            if not cuda:
                t0 = time.perf_counter()
                _step(model, batches[v], seeds)
                ms = (time.perf_counter() - t0) * 1e3
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                _step(model, batches[v], seeds)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            if it >= args.warmup:
                times[v].append(ms)
    med = {v: statistics.median(t) for v, t in times.items()}
    ratio = med["per_projection_a"] / med["shared_a"]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    print(f"{name}: {args.preset} {args.layers} layers, {args.tokens} tokens, {args.adapters} adapters r={args.r}")
    for v in variants:
        print(f"  {v:17s} fwd+bwd median {med[v]:8.1f} ms  (all {', '.join(f'{x:.1f}' for x in times[v])})  "
              f"LoRA params {params[v]:,}  tokens/s {args.tokens / med[v] * 1e3:,.0f}")
    print(f"  per-projection A / shared A: {ratio:.4f}  peak memory {peak:.1f} GiB")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    rec = {"device": name, "peak_mem_gib": peak, "torch": torch.__version__, "commit": commit, **vars(args),
           "median_ms": med, "all_ms": times, "lora_params": params, "ratio_per_projection_over_shared": ratio}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=2)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
