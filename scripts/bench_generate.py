#!/usr/bin/env python3
"""Decoding speed of ``lorafusion generate`` after a warm-up, beside transformers + PEFT ``generate`` on the
same weights and adapter. Times :func:`lorafusion.inference.generate.generate_ids`, the function the CLI
runs for every batch (packed prefill, then one packed row per live sequence per step through the KV cache), on
a preset base with random weights and LoRA adapters (r=16, all-linear, B drawn nonzero so every LoRA term
computes).

Every sequence decodes exactly ``--new-tokens`` tokens (no eos: ours with ``eos_id=-1``, transformers with
``min_new_tokens``), greedy. Each timed call is bracketed by CUDA events; the first call is the warm-up
(Triton JIT, cuBLAS heuristics) and is reported apart; tokens/s = new tokens / median time over ``--repeats``.
``--decode`` picks generate_ids' decode steps (default auto: on a GPU the static step replayed from a CUDA
graph, :mod:`lorafusion.inference.static_decode`; ``--also-dynamic`` times the packed step of live rows beside
it); ``ms_per_decode_step`` = (median time - the prefill alone) / (new tokens - 1), capture and warm-up
included. ``syncs_per_decode_step``: device-to-host syncs one decode step makes, counted with
``torch.cuda.set_sync_debug_mode("warn")`` (one is needed: the picked tokens, to see who has finished).

  python scripts/bench_generate.py --model tiny-llama --prompts configs/quickstart/heldout.jsonl --out A.json
  python scripts/bench_generate.py --model llama3.1-8b --batch 8 --hf --out B.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from _bench import run_info, timed_ms

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: a smoke run of the script; no numbers to report)


def build(preset_name: str, adapters: list[str], dtype: str, seed: int, impl: str | None = None):
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.dist import init_distributed
    from lorafusion.layers import adapter_parameters, add_adapter
    from lorafusion.models.base import build_base

    init_distributed(1, 1, seed=seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    arch = preset(preset_name)
    # lora_impl None as build_run_model: the fused kernels on CUDA
    model = build_base(arch, dtype=dtype, device=dev, seed=seed, lora_impl=impl)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name in adapters:
        add_adapter(model, name, LoRASpec(r=16, lora_alpha=32, target_modules="all-linear"), seed=seed)
        for key, p in adapter_parameters(model, name).items():
            if key.endswith("lora_B"):
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval(), arch


def prompt_rows(args, adapters: list[str], vocab: int) -> list[tuple[str | None, list[int]]]:
    """(job, prompt ids): the rows of ``--prompts`` (byte tokenizer, as generate encodes them), else
    ``--batch`` random prompts of ``--prompt-len`` lo-hi tokens, spread over the adapters round-robin."""
    if args.prompts:
        from lorafusion.data.tokenizer import ByteTokenizer
        from lorafusion.inference.generate import encode_prompt

        tok = ByteTokenizer()
        rows = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
        return [(r.get("job"), encode_prompt(r, tok, "bench")) for r in rows][: args.batch or None]
    g = torch.Generator().manual_seed(args.seed)
    lo, hi = (int(x) for x in args.prompt_len.split("-"))
    out = []
    for i in range(args.batch):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(
            (adapters[i % len(adapters)], [1, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()]))
    return out


def timed(fn) -> float:
    """Seconds of one call (CUDA events on a GPU)."""
    return timed_ms(fn) / 1e3


def ours(model, rows, args, context: int, decode: str | None = None) -> dict:
    """``generate_ids`` timed (``decode``: args.decode); prefill alone (one new token) timed too, so the
    decode steps' share is known; capture fallbacks (GraphCaptureWarning) recorded."""
    from lorafusion.inference.generate import Request, generate_ids
    from lorafusion.inference.static_decode import GraphCaptureWarning

    reqs: list = []
    decode = decode or args.decode

    def run(new=args.new_tokens):
        reqs[:] = [Request({}, job, ids, "bench") for job, ids in rows]
        generate_ids(model, reqs, eos_id=-1, max_new_tokens=new, context=context, decode=decode)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphCaptureWarning)
        first = timed(run)
        times = [timed(run) for _ in range(args.repeats)]
    outputs = [r.output_ids for r in reqs]
    new = sum(len(o) for o in outputs)
    prefill = statistics.median([timed(lambda: run(1)) for _ in range(2)])
    med = statistics.median(times)
    return {"decode": decode, "first_call_s": round(first, 3), "times_s": [round(t, 4) for t in times],
            "new_tokens": new, "tokens_per_s": round(new / med, 1), "prefill_only_s": round(prefill, 4),
            "ms_per_decode_step": round((med - prefill) / max(args.new_tokens - 1, 1) * 1e3, 2),
            "capture_warnings": [str(w.message)[:400] for w in caught
                                 if issubclass(w.category, GraphCaptureWarning)],
            "outputs": outputs}


def sync_count(model, rows, args, context: int) -> float | None:
    """Device-to-host syncs per decode step: one call with ``new_tokens`` and one with a single token (prefill
    only), warnings counted; (difference) / (new_tokens - 1)."""
    from lorafusion.inference.generate import Request, generate_ids

    if DEV == "cpu":
        return None

    def count(n: int) -> int:
        reqs = [Request({}, job, ids, "bench") for job, ids in rows]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                generate_ids(model, reqs, eos_id=-1, max_new_tokens=n, context=context, decode=args.decode)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(x.message) for x in w)

    n = min(args.new_tokens, 16)
    return round((count(n) - count(1)) / (n - 1), 2)


def profile(model, rows, context: int, steps: int = 8) -> str:
    """torch.profiler's table (top 25 by self device time, else CPU time) of ``steps`` decode tokens."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from lorafusion.inference.generate import Request, generate_ids

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with prof(activities=acts) as p:
        generate_ids(model, [Request({}, j, ids, "bench") for j, ids in rows], eos_id=-1,
                     max_new_tokens=steps, context=context)
    key = "self_cuda_time_total" if DEV == "cuda" else "self_cpu_time_total"
    return p.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)


def hf_peft(model, arch, adapter: str):
    """transformers + PEFT on the same weights: the base's HF state and the adapter's PEFT export."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion.core.arch import arch_to_hf_config
    from lorafusion.export.peft import export_peft_adapter
    from lorafusion.models.hf_export import hf_state_from_model

    cfg = arch_to_hf_config(arch)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.set_default_dtype(next(model.parameters()).dtype)
    try:
        with torch.device(DEV):
            hf = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    hf = hf.to(next(model.parameters()).dtype)
    missing, unexpected = hf.load_state_dict(dict(hf_state_from_model(model, arch)), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tmp = Path(tempfile.mkdtemp()) / adapter
    export_peft_adapter(model, adapter, tmp, arch, base_model="bench")
    return PeftModel.from_pretrained(hf, str(tmp)).eval()


def theirs(hf, rows, args) -> dict:
    """transformers ``generate``: the batch left-padded with an attention mask, greedy, exactly new_tokens."""
    width = max(len(ids) for _, ids in rows)
    ids = torch.tensor([[0] * (width - len(x)) + x for _, x in rows], device=DEV)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for _, x in rows], device=DEV)
    out: list = []

    def run():
        with torch.no_grad():
            out[:] = [hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False, num_beams=1,
                                  pad_token_id=0)]

    first = timed(run)
    times = [timed(run) for _ in range(args.repeats)]
    new = len(rows) * args.new_tokens
    return {"first_call_s": round(first, 3), "times_s": [round(t, 4) for t in times], "new_tokens": new,
            "tokens_per_s": round(new / statistics.median(times), 1),
            "outputs": out[0][:, width:].tolist()}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", help="a generate prompts file (rows' jobs name the adapters)")
    ap.add_argument("--batch", type=int, default=8,
                    help="random prompts (without --prompts); with it: the first N")
    ap.add_argument("--prompt-len", default="64-256")
    ap.add_argument("--adapters", type=int, default=1, help="random prompts spread over this many adapters")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", choices=["fused", "reference"], help="LoRA ops (default: fused on CUDA)")
    ap.add_argument("--also-reference", action="store_true",
                    help="time ours again with the torch reference LoRA ops (same model, after the fused "
                         "run)")
    ap.add_argument("--also-batch", type=int, help="time ours again on the first N rows only (same model)")
    ap.add_argument("--decode", default="auto",
                    help="generate_ids' decode steps (auto: the CUDA graph on a GPU)")
    ap.add_argument("--also-dynamic", action="store_true", help="time ours again with decode=dynamic (the "
                    "packed step of live rows, no graph) and count the rows whose tokens equal")
    ap.add_argument("--profile", help="also write torch.profiler's table of 8 decode tokens to this file")
    ap.add_argument("--hf", action="store_true", help="also transformers + PEFT generate (one adapter only)")
    ap.add_argument("--skip-syncs", action="store_true", help="do not count the syncs per decode step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    from lorafusion.core.arch import preset

    adapters = [f"a{i}" for i in range(args.adapters)]
    if args.prompts:
        adapters = sorted({json.loads(x).get("job") for x in Path(args.prompts).read_text().splitlines()
                           if x.strip()} - {None})
    model, arch = build(args.model, adapters, args.dtype, args.seed, args.impl)
    rows = prompt_rows(args, adapters, arch.vocab_size)
    context = preset(args.model).max_position_embeddings
    res = {**run_info(),
           "model": args.model, "dtype": args.dtype, "lora_impl": args.impl or "auto", "rows": len(rows),
           "adapters": adapters,
           "prompt_tokens": [len(x) for _, x in rows], "new_tokens_per_row": args.new_tokens}
    res["lorafusion"] = ours(model, rows, args, context)
    save(res, args.out)  # after each phase: a run cut short by its time limit keeps what it measured
    if not args.skip_syncs:
        res["syncs_per_decode_step"] = sync_count(model, rows, args, context)
    if args.hf:
        if len(adapters) != 1:
            raise SystemExit("--hf compares one adapter (--adapters 1)")
        res["transformers_peft"] = theirs(hf_peft(model, arch, adapters[0]), rows, args)
        a, b = res["lorafusion"]["outputs"], res["transformers_peft"]["outputs"]
        res["rows_same_first_8_tokens"] = sum(x[:8] == y[:8] for x, y in zip(a, b, strict=True))
        res["speedup_vs_transformers_peft"] = round(res["lorafusion"]["tokens_per_s"]
                                                    / res["transformers_peft"]["tokens_per_s"], 3)
        save(res, args.out)
    if args.also_reference:
        from lorafusion.layers import get_lora_context

        ctx, impl = get_lora_context(model), get_lora_context(model).impl
        ctx.impl = "reference"
        res["lorafusion_reference_lora"] = ours(model, rows, args, context)
        ctx.impl = impl
        save(res, args.out)
    if args.also_dynamic:
        res.update(against_dynamic(res["lorafusion"], ours(model, rows, args, context, decode="dynamic")))
        save(res, args.out)
    if args.also_batch:
        res[f"lorafusion_first_{args.also_batch}_rows"] = ours(model, rows[: args.also_batch], args, context)
    if args.profile:
        Path(args.profile).write_text(profile(model, rows, context))
    save(res, args.out)
    print(Path(args.out).read_text())


def against_dynamic(mine: dict, dynamic: dict) -> dict:
    """The dynamic step's timing beside ours: rows whose tokens equal, and the speed ratio."""
    return {"lorafusion_dynamic": dynamic,
            "rows_same_as_dynamic": sum(x == y
                                        for x, y in zip(mine["outputs"], dynamic["outputs"], strict=True)),
            "speedup_vs_dynamic": round(mine["tokens_per_s"] / dynamic["tokens_per_s"], 3)}


def save(res: dict, out: str) -> None:
    """``res`` as JSON, without the generated token ids."""
    clean = {k: ({kk: vv for kk, vv in v.items() if kk != "outputs"} if isinstance(v, dict) else v)
             for k, v in res.items()}
    Path(out).write_text(json.dumps(clean, indent=1) + "\n")


if __name__ == "__main__":
    main()
