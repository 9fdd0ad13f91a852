"""FP8 base quality, forward vs backward (issue 23): LoRA-gradient cosine and loss error against float64.

    PYTHONPATH=$PWD python scripts/fp8_ablate.py [--hidden 64] [--layers 4] [--tokens 512] [--outliers 0]

One random bf16 base (the tiny-llama preset, or its shape with ``--hidden``/``--ffn``), 4 adapters r=16
all-linear (dropout 0, B ~ N(0, 0.01) so every A has a gradient), one packed microbatch of random tokens.
Reference: the same model converted to float64 from the ORIGINAL bf16 weights (no quantization). Each mode
replaces the decoder linears' base GEMM (``lorafusion.layers.fp8_base.fp8_linear``) by
  forward  exact: X·Wᵀ (original W)   w: X·deq(W_q)ᵀ (weights-only)   fp8: the shipped row-wise FP8 GEMM
  backward exact: dY·W (original W)   w: dY·deq(W_q)                  fp8: the shipped dY e4m3 per row GEMM
and the control ``noise``: W·(1+e), e = W's own relative e4m3 errors shuffled within each row (FP8-sized
random noise, not FP8),
(the exact/w products in float32, cast to bf16 like the shipped op). ``--outliers F`` multiplies the input
RMSNorm weight of 4 hidden channels per layer by F (the massive-activation channels of trained LLMs) to see
per-row X quantization under outliers. ``--pretrain N``: first train the whole base (float32, AdamW) for N
steps on the quickstart data as bytes, then cast it to bf16, and take the microbatch from that text. Prints one JSON per mode: per-tensor cosine (median, min), the cosine
of all LoRA gradients concatenated, and the relative error of every adapter's loss. ``--keep 1,2,4``: the shipped FP8 with the first N decoder layers
exact (bf16, as ``quantize_base(bf16_layers=N)``); ``--per-layer``: FP8 in one layer at a time, the others exact;
``--modes shipped``: of the forward/backward rows only the shipped one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorafusion.layers import fp8_base as FB  # noqa: E402
from lorafusion.ops import fp8_linear as F  # noqa: E402

ORIG: dict[int, torch.Tensor] = {}  # id(weight_fp8) -> the original bf16 weight
NOISY: dict[int, torch.Tensor] = {}  # id(weight_fp8) -> W·(1 + e), e: W's own relative e4m3 errors shuffled
MODE = {"fwd": "fp8", "bwd": "fp8"}
LAYER: dict[int, int] = {}  # id(weight_fp8) -> its decoder layer (1-based)
EXACT_LAYERS: set[int] = set()  # layers whose linears run exact (their original weight) in both directions


def _mode(w_q, direction: str) -> str:
    return "exact" if LAYER.get(id(w_q)) in EXACT_LAYERS else MODE[direction]


def _weight(w_q, w_s, mode):
    if mode == "exact":
        return ORIG[id(w_q)].float()
    return NOISY[id(w_q)] if mode == "noise" else F.dequantize(w_q, w_s, torch.float32)


def _noisy(w, w_q, w_s, gen):
    """W·(1 + e) with e the elementwise relative quantization errors of W, shuffled within each row: the same
    error statistics as e4m3 at random places (a control: is the gradient change FP8's, or any such noise)."""
    w = w.float()
    rel = torch.where(w != 0, F.dequantize(w_q, w_s, torch.float32) / w - 1, 0.0)
    idx = torch.argsort(torch.rand(rel.shape, generator=gen), dim=1)
    return w * (1 + rel.gather(1, idx))


class _Ablate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w_q, w_s):
        ctx.save_for_backward(w_q, w_s)
        if _mode(w_q, "fwd") == "fp8":
            x_q, s_x = F.quantize_rows(x2d, F.E4M3)
            return F.scaled_gemm(x_q, s_x, w_q, w_s.view(1, -1), x2d.dtype)
        w = _weight(w_q, w_s, _mode(w_q, "fwd"))
        return (x2d.float() @ w.t()).to(x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        w_q, w_s = ctx.saved_tensors
        if _mode(w_q, "bwd") == "fp8":
            g_q, s_g = F.quantize_rows(dy, F.GRAD_DTYPE, col_scale=w_s)
            ones = torch.ones(1, w_q.shape[1], dtype=torch.float32)
            return F.scaled_gemm(g_q, s_g, F.transpose(w_q), ones, dy.dtype), None, None
        w = _weight(w_q, w_s, _mode(w_q, "bwd"))
        return (dy.float() @ w).to(dy.dtype), None, None


def _patched(x, w_q, w_s, bias=None, grad_dtype=None):
    y = _Ablate.apply(x.reshape(-1, x.shape[-1]), w_q, w_s)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def build(args):
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.dist import init_distributed
    from lorafusion.layers import add_adapter, lora_modules
    from lorafusion.models.provider import build_model

    init_distributed(1, 1, seed=args.seed)
    arch = preset("tiny-llama", hidden_size=args.hidden, ffn_hidden_size=args.ffn or args.hidden * 5 // 2,
                  num_layers=args.layers)
    model = build_model(arch, params_dtype=torch.float32 if args.pretrain else torch.bfloat16,
                        device=torch.device("cpu"), seed=args.seed)
    if args.pretrain:
        pretrain(model, args.pretrain)
        model.to(torch.bfloat16)
    names = [f"job{i}" for i in range(4)]
    for name in names:
        add_adapter(model, name, LoRASpec(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=("all-linear",)),
                    seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for n in sorted(mod.lora_B):
                mod.lora_B[n].copy_(torch.randn(mod.lora_B[n].shape, generator=gen) * 0.01)
        if args.outliers:
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") and "final" not in name:
                    p[..., :4] *= args.outliers
    return model.train(), names


def text_tokens() -> list[int]:
    """The quickstart data files as bytes (one JSON object a line): a small real text for --pretrain."""
    root = Path(__file__).resolve().parents[1] / "configs" / "quickstart" / "data"
    return list(b"".join(f.read_bytes() for f in sorted(root.glob("*.jsonl"))))


def text_samples(names, n_tokens, gen):
    data = torch.tensor(text_tokens())
    out = []
    for i in range(n_tokens // 64):
        start = int(torch.randint(0, len(data) - 64, (1,), generator=gen))
        out.append((names[i * len(names) // (n_tokens // 64)], data[start:start + 64].tolist()))
    return out


def pretrain(model, steps: int) -> None:
    """Train every base weight (float32, AdamW) on the quickstart text: a base with learned structure."""
    from lorafusion.data import pack_microbatch

    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        batch = pack_microbatch(text_samples(["pre"], 512, gen))
        per_token = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                          packed_seq_params=batch.packed_seq_params())
        loss = (per_token.float() * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 100 == 0 or i == steps - 1:
            print(f"pretrain step {i} loss {loss.item():.3f}", flush=True)
    for p in params:
        p.requires_grad_(False)
        p.grad = None


def step(model, batch, names):
    """Loss per adapter and every LoRA gradient in float64 (check_fp8's step)."""
    from check_fp8 import step as check_step

    return check_step(model, batch, names, dtype=torch.float64)


def compare(res, ref):
    (l8, g8), (l64, g64) = res, ref
    cos = [float(torch.nn.functional.cosine_similarity(g8[k].flatten(), g64[k].flatten(), dim=0)) for k in g64]
    flat8 = torch.cat([g8[k].flatten() for k in g64])
    flat64 = torch.cat([g64[k].flatten() for k in g64])
    return {"cos_median": round(statistics.median(cos), 4), "cos_min": round(min(cos), 4),
            "cos_all": round(float(torch.nn.functional.cosine_similarity(flat8, flat64, dim=0)), 5),
            "grad_rel_err": round(float((flat8 - flat64).norm() / flat64.norm()), 4),
            "loss_rel_err_max": float(f"{max(abs(l8[n] / l64[n] - 1) for n in l64):.2e}")}


def main() -> None:
    from lorafusion.data import pack_microbatch
    from lorafusion.layers import lora_modules

    ap = argparse.ArgumentParser()
    for k, v in (("hidden", 64), ("ffn", 0), ("layers", 4), ("tokens", 512), ("seed", 1234), ("pretrain", 0)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--outliers", type=float, default=0.0)
    ap.add_argument("--keep", default="", help="comma list of N: FP8 with the first N layers exact (bf16)")
    ap.add_argument("--per-layer", action="store_true", help="FP8 in one layer at a time, the others exact")
    ap.add_argument("--modes", default="all", help="'all' or 'shipped': which forward/backward rows to run")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, names = build(args)
    g = torch.Generator().manual_seed(5)
    parts = [int(args.tokens * f) for f in (0.3, 0.15, 0.35)]
    parts.append(args.tokens - sum(parts))
    samples = [(n, torch.randint(0, 500, (t,), generator=g).tolist()) for n, t in zip(names, parts)]
    if args.pretrain:  # a trained base: the microbatch is text of the kind it was trained on
        samples = text_samples(names, args.tokens, g)
    batch = pack_microbatch(samples, row_ids=list(range(len(samples))))
    tensors = list(model.parameters()) + list(model.buffers())
    saved = [(t, t.data.clone()) for t in tensors]
    model.double()
    ref = step(model, batch, names)
    model.to(torch.bfloat16)
    with torch.no_grad():
        for t, v in saved:
            t.data = v
    out = {"args": vars(args), "bf16": compare(step(model, batch, names), ref)}
    mods = [m for _, m in lora_modules(model)]
    weights = [m.weight.data.clone() for m in mods]
    FB.quantize_base(model, "fp8", bf16_layers=0)  # every layer: the modes below choose per layer
    for (key, m), w in zip(lora_modules(model), weights):
        ORIG[id(m.weight_fp8)] = w
        LAYER[id(m.weight_fp8)] = int(key.split(".")[0])
        NOISY[id(m.weight_fp8)] = _noisy(w, m.weight_fp8, m.weight_scale, torch.Generator().manual_seed(9))
    FB.fp8_linear = _patched
    rows = (("exact", "exact"), ("fp8", "fp8"), ("fp8", "exact"), ("exact", "fp8"), ("w", "w"),
            ("w", "exact"), ("fp8", "w"), ("w", "fp8"), ("noise", "noise"))
    for fwd, bwd in rows if args.modes == "all" else rows[1:2]:
        MODE.update(fwd=fwd, bwd=bwd)
        out[f"fwd={fwd},bwd={bwd}"] = compare(step(model, batch, names), ref)
    MODE.update(fwd="fp8", bwd="fp8")
    for keep in [int(v) for v in args.keep.split(",") if v]:
        EXACT_LAYERS.clear()
        EXACT_LAYERS.update(range(1, keep + 1))
        out[f"fp8, first {keep} layers bf16"] = compare(step(model, batch, names), ref)
    for layer in range(1, args.layers + 1) if args.per_layer else ():
        EXACT_LAYERS.clear()
        EXACT_LAYERS.update(set(range(1, args.layers + 1)) - {layer})
        out[f"fp8 in layer {layer} only"] = compare(step(model, batch, names), ref)
    EXACT_LAYERS.clear()
    for k, v in out.items():
        print(k, json.dumps(v), flush=True)


if __name__ == "__main__":
    main()
