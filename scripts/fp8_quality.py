"""FP8 base quality on real weights: LoRA-gradient cosines of ``model.base_precision: fp8`` against bf16 on a
HF model (by default SmolLM2-135M-Instruct, ``make real-model``) with the SmolLM2 example's adapters and
data, and the example's loss curves in both precisions.

    python scripts/fp8_quality.py --out real-model-fp8.json [--adapters RUN/adapters] [--drill] [--per-layer]
    python scripts/fp8_quality.py --no-grads --curves --png loss.png --out ...    # 2 trainings of the example

Gradients (``grads``): one packed microbatch of the example's training chats (``--per-job`` samples of each of
its three jobs, tokenized with the model's chat template, loss on the answers), the three adapters of the
example's job YAMLs (r, alpha, targets) with B drawn N(0, ``--b-std``) so that every A has a gradient, or the
trained adapters of a run (``--adapters RUN/adapters``). Every LoRA gradient (A and B of each targeted linear
of each layer and adapter) is computed with the base in float32, in bf16, and with the bf16 base's decoder
linears in FP8 as training uses them (the shipped default: layer 1 stays bf16; and all layers FP8). Reported:
cosine per tensor against bf16 (and bf16 against float32, the bf16 floor), the median, min and the median per
layer and per linear kind, and the worst tensors.

Where the FP8 median is below 0.99 (``drill``): the same cosine with FP8 in one linear kind only (qkv, proj,
fc1, fc2), with only the weights rounded to FP8 (per output channel, the GEMMs in bf16: the weight's share of
the error), and with ``--per-layer`` FP8 in one decoder layer only; plus each kind's activation outliers (the
largest |X| over the median row amax of X, which the per-row scale of X divides the rest of the row by).

``--curves``: trains the example twice through configs/smollm2/run.py (``model.dtype=bfloat16``, with and
without ``model.base_precision=fp8``; ``--runs BF16_DIR FP8_DIR`` reuses two finished runs), overlays each
job's loss per step in one PNG and records both runs' final losses and held-out accuracies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLE = ROOT / "configs" / "smollm2"
JOBS = ("third_person", "json_person", "word_problem")
KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def example_batch(tokenizer, per_job: int):
    """One packed microbatch: the first ``per_job`` chats of each job's training file, loss on the answers."""
    from lorafusion.data import pack_microbatch
    from lorafusion.data.dataset import build_sample

    samples, prompts = [], []
    for job in JOBS:
        lines = (EXAMPLE / "data" / f"{job}.jsonl").read_text().splitlines()[:per_job]
        for line in lines:
            p, r = tokenizer.apply_chat(json.loads(line)["messages"])
            ids, plen = build_sample(p, r, tokenizer, mask_prompt=True)
            samples.append((job, ids))
            prompts.append(plen)
    return pack_microbatch(samples, prompt_lengths=prompts, row_ids=list(range(len(samples))))


def lora_spec(job: str):
    import yaml

    from lorafusion.core.lora import LoRASpec

    lora = yaml.safe_load((EXAMPLE / f"{job}.yaml").read_text())["lora"]
    targets = lora["target_modules"]
    return LoRASpec(r=lora["r"], lora_alpha=lora["lora_alpha"],
                    target_modules=(targets,) if isinstance(targets, str) else tuple(targets))


def with_adapters(model, adapters: Path | None, b_std: float):
    from lorafusion.export.peft import import_peft_adapter
    from lorafusion.layers import add_adapter, lora_modules

    for i, job in enumerate(JOBS):
        if adapters is not None:
            import_peft_adapter(model, job, adapters / job)
        else:
            add_adapter(model, job, lora_spec(job), seed=i)
    if adapters is None:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, mod in lora_modules(model):
                for n in sorted(mod.lora_B):
                    mod.lora_B[n].copy_(torch.randn(mod.lora_B[n].shape, generator=gen) * b_std)
    return model.train()


def grads_of(model, batch) -> dict[str, torch.Tensor]:
    """Every LoRA gradient (float64) of the summed per-job token-mean losses of ``batch``."""
    from lorafusion.layers import lora_batch, lora_modules

    model.zero_grad(set_to_none=True)
    dev = next(model.parameters()).device
    batch = batch.to(dev)
    with lora_batch(model, batch.routing, batch.adapters, [11 + i for i in range(len(batch.adapters))]):
        per_token = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                          packed_seq_params=batch.packed_seq_params())
    loss = 0.0
    for n in JOBS:
        msk = batch.adapter_token_mask(n).float() * batch.loss_mask.float()
        loss = loss + (per_token.float() * msk).sum() / msk.sum()
    loss.backward()
    return {f"{key}.{p}.{n}": getattr(mod, p)[n].grad.detach().double().cpu().clone()
            for key, mod in lora_modules(model) for p in ("lora_A", "lora_B") for n in getattr(mod, p)}


def cosines(grads: dict, ref: dict) -> dict[str, float]:
    return {k: float(torch.nn.functional.cosine_similarity(grads[k].flatten(), ref[k].flatten(), dim=0))
            for k in ref}


def summary(cos: dict[str, float], worst: int = 0) -> dict:
    """Median / min over all tensors, medians per layer and per linear kind (keys:
    "<layer>.<kind>.lora_X.job")."""
    vals = sorted(cos.values())
    layers: dict = {}
    kinds: dict = {}
    for key, v in cos.items():
        layer, kind = key.split(".")[:2]
        layers.setdefault(int(layer), []).append(v)
        kinds.setdefault(kind, []).append(v)
    out = {"tensors": len(vals), "median": round(statistics.median(vals), 5), "min": round(vals[0], 5),
           "below_0.99": sum(v < 0.99 for v in vals),
           "median_by_layer": {k: round(statistics.median(v), 4) for k, v in sorted(layers.items())},
           "median_by_kind": {k: round(statistics.median(v), 4) for k, v in sorted(kinds.items())}}
    if worst:
        out["worst"] = [[k, round(v, 4)] for k, v in sorted(cos.items(), key=lambda kv: kv[1])[:worst]]
    return out


@contextlib.contextmanager
def fp8_in(model, layers: set[int] | None = None, kinds: set[str] | None = None, weight_only: bool = False):
    """The bf16 ``model`` with the decoder linears of ``layers`` (1-based; None: all) and ``kinds`` (None:
    all) in FP8 as training runs them, or with only their weights rounded to FP8 (``weight_only``: the GEMMs
    stay bf16); restored on exit. (A deep copy of a Megatron model fails on its process groups.)"""
    from lorafusion.layers.fp8_base import drop_fp8_storage, init_fp8_storage, write_base_tensor
    from lorafusion.layers.inject import lora_modules
    from lorafusion.ops.fp8_linear import quantize_weight

    saved = []
    try:
        for _, mod in lora_modules(model):
            if (layers is None or mod.layer_number in layers) and (kinds is None or mod.lora_kind in kinds):
                weight = mod.weight
                saved.append((mod, weight, weight.data.clone() if weight_only else None, mod.base_precision))
                if weight_only:
                    q, s = quantize_weight(weight.data)
                    with torch.no_grad():
                        weight.copy_((q.float() * s.view(-1, 1)).to(weight.dtype))
                else:  # what building the linear with an FP8 base does (lorafusion.layers.fp8_base)
                    init_fp8_storage(mod)
                    with torch.no_grad():
                        write_base_tensor(mod, "weight", weight.data)
                    mod.base_precision = "fp8"
        yield model
    finally:
        for mod, weight, data, precision in saved:
            if data is not None:
                with torch.no_grad():
                    weight.copy_(data)
            else:
                drop_fp8_storage(mod, weight)
                mod.base_precision = precision


def fp8_grads(model, batch, **where) -> dict[str, torch.Tensor]:
    with fp8_in(model, **where):
        return grads_of(model, batch)


def activation_ranges(model, batch) -> dict[str, float]:
    """Per linear kind, the largest ratio over rows of X between the row's largest |x| and its median |x|: how
    far the per-row FP8 scale, set by the row's largest entry, pushes the typical entries down."""
    from lorafusion.layers import lora_batch
    from lorafusion.layers.inject import lora_modules

    worst: dict[str, float] = {}

    def hook(mod, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs()
        ratio = float((x.amax(dim=1) / x.median(dim=1).values.clamp_min(1e-30)).max())
        worst[mod.lora_kind] = max(worst.get(mod.lora_kind, 0.0), ratio)

    handles = [mod.register_forward_pre_hook(hook) for _, mod in lora_modules(model)]
    try:
        with torch.no_grad(), lora_batch(model, batch.routing, batch.adapters):
            model(batch.tokens, batch.position_ids, attention_mask=None,
                  packed_seq_params=batch.packed_seq_params())
    finally:
        for h in handles:
            h.remove()
    return {k: round(v, 1) for k, v in sorted(worst.items())}


def grads_section(args) -> dict:
    from lorafusion.data.tokenizer import HFTokenizer
    from lorafusion.dist import init_distributed
    from lorafusion.models.hf_import import build_model_from_hf

    init_distributed(1, 1, seed=0)
    batch = example_batch(HFTokenizer(args.model), args.per_job)
    dev = torch.device(args.device)

    def model_in(dtype):
        model = build_model_from_hf(args.model, params_dtype=dtype).to(dev)
        return with_adapters(model, args.adapters, args.b_std)

    t0 = time.perf_counter()
    g32 = grads_of(model_in(torch.float32), batch)
    m16 = model_in(torch.bfloat16)
    g16 = grads_of(m16, batch)
    n_layers = max(int(k.split(".")[0]) for k in g16)
    g8 = fp8_grads(m16, batch, layers=set(range(2, n_layers + 1)))
    out = {"tokens": int(batch.tokens.numel()), "per_job": args.per_job,
           "adapters": str(args.adapters) if args.adapters else f"example specs, B ~ N(0, {args.b_std})",
           "bf16_vs_fp32": summary(cosines(g16, g32)),
           "fp8_vs_bf16": summary(cosines(g8, g16), worst=12), "fp8_vs_fp32": summary(cosines(g8, g32)),
           "fp8_all_layers_vs_bf16": summary(cosines(fp8_grads(m16, batch), g16))}
    print(f"LoRA-gradient cosine, median: fp8 vs bf16 {out['fp8_vs_bf16']['median']:.4f} (all layers fp8: "
          f"{out['fp8_all_layers_vs_bf16']['median']:.4f}); bf16 vs fp32 {out['bf16_vs_fp32']['median']:.4f}",
          file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"grads": out}, indent=1) + "\n")  # kept if the drill is cut short
    if out["fp8_vs_bf16"]["median"] < 0.99 or args.drill:
        out["drill"] = drill(m16, batch, g16, n_layers, args.per_layer)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def drill(m16, batch, g16, n_layers: int, per_layer: bool) -> dict:
    """Which base tensors drive the FP8 gradient error (see the module docstring)."""
    rest = set(range(2, n_layers + 1))
    med = {}
    for kind in KINDS:
        grads = fp8_grads(m16, batch, layers=rest, kinds={kind})
        med[f"fp8_only_{kind}"] = summary(cosines(grads, g16))["median"]
    med["fp8_weights_only_bf16_gemms"] = summary(cosines(fp8_grads(m16, batch, layers=rest, weight_only=True),
                                                         g16))["median"]
    med["bf16_again_after_restoring"] = summary(cosines(grads_of(m16, batch), g16))["median"]  # must be 1
    out = {"median_when": med, "activation_row_range": activation_ranges(m16, batch)}
    if per_layer:
        out["median_fp8_in_one_layer_only"] = {
            layer: summary(cosines(fp8_grads(m16, batch, layers={layer}), g16))["median"]
            for layer in range(1, n_layers + 1)}
    print(f"drill: {json.dumps(med)}", file=sys.stderr)
    return out


def example_run(out: Path, fp8: bool) -> Path:
    extra = ["model.dtype=bfloat16", "logging.progress=false"] + (["model.base_precision=fp8"] if fp8 else [])
    cmd = [sys.executable, str(EXAMPLE / "run.py"), "--out", str(out), *extra]
    subprocess.run(cmd, cwd=ROOT, check=False)
    return out


def losses(run: Path) -> dict[str, list[tuple[int, float]]]:
    per: dict = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("loss") is not None:
            per.setdefault(row["job"], []).append((row["step"], row["loss"]))
    return per


def curves_section(args) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = [Path(r) for r in args.runs] if args.runs else [
        example_run(ROOT / "outputs" / "smollm2-fp8" / f"{stamp}-{p}", p == "fp8") for p in ("bf16", "fp8")]
    curves = {p: losses(r) for p, r in zip(("bf16", "fp8"), runs)}
    fig, axes = plt.subplots(1, len(JOBS), figsize=(4.2 * len(JOBS), 3.4))
    for ax, job in zip(axes, JOBS):
        for p, style in (("bf16", "-"), ("fp8", "--")):
            steps, vals = zip(*curves[p][job])
            ax.plot(steps, vals, style, marker="o", ms=3, label=f"base {p}")
        ax.set_yscale("log")
        ax.set_title(job)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (token mean)")
    axes[0].legend()
    fig.suptitle("SmolLM2-135M-Instruct example: bf16 base vs FP8 base (layer 1 bf16)")
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    out: dict = {"png": str(args.png.relative_to(ROOT)) if args.png.is_relative_to(ROOT) else str(args.png)}
    for p, run in zip(("bf16", "fp8"), runs):
        res = json.loads((run / "result.json").read_text()) if (run / "result.json").is_file() else {}
        out[p] = {"run": str(run), "final_loss": {j: curves[p][j][-1][1] for j in JOBS},
                  "accuracy": {j: r["adapter"] for j, r in res.get("accuracy", {}).items()},
                  "base_accuracy": {j: r["base"] for j, r in res.get("accuracy", {}).items()},
                  "train_s": res.get("train_s"), "device": res.get("device")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--adapters", type=Path, help="a run's adapters/ directory (default: B drawn at random)")
    ap.add_argument("--b-std", type=float, default=0.01)
    ap.add_argument("--per-job", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--drill", action="store_true", help="drill down even when the median is >= 0.99")
    ap.add_argument("--per-layer", action="store_true", help="drilling: FP8 in each single layer too")
    ap.add_argument("--no-grads", action="store_true", help="skip the gradient cosines")
    ap.add_argument("--curves", action="store_true", help="train the example in bf16 and in fp8 and plot")
    ap.add_argument("--runs", nargs=2, metavar=("BF16_RUN", "FP8_RUN"), help="with --curves: finished runs")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "results" / "real-model-fp8-loss.png")
    args = ap.parse_args(argv)
    result: dict = {"model": str(args.model), "device": str(args.device), "command": " ".join(sys.argv)}
    if not args.no_grads:
        result["grads"] = grads_section(args)
    if args.curves:
        result["curves"] = curves_section(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
