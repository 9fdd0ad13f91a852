"""``lorafusion`` command line: train | plan | export | smoke."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# megatron-core warns at import that Apex / Transformer Engine are absent; the local paths are intended.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")

NOT_YET = (
    "lorafusion {cmd}: not built yet — the multi-adapter training runtime (YAML jobs, data, scheduler-driven "
    "1F1B, per-adapter optimizers) is the runtime issue, still open.\n"
    "What works today: Megatron-core LLaMA/Qwen2 models with any number of LoRA adapters (TP/PP), HF import, "
    "PEFT export/import. `lorafusion smoke` runs them end to end on a tiny model."
)


def cmd_smoke(args) -> int:
    """Tiny model, three adapters of ranks 8/16/32, one packed microbatch forward+backward, PEFT export."""
    import time

    import torch

    from lorafusion.data import pack_microbatch
    from lorafusion.layers import LoRASpec, add_adapter, lora_batch, lora_modules
    from lorafusion.models.provider import build_model
    from lorafusion.models.spec import preset
    from lorafusion.runtime.dist import init_distributed
    from lorafusion.runtime.export import export_peft_adapter

    t0 = time.time()
    init_distributed(1, 1)
    arch = preset(args.preset)
    model = build_model(arch, device="cuda" if torch.cuda.is_available() else None)
    specs = {"sql": LoRASpec(r=8, lora_alpha=16), "summarize": LoRASpec(r=16, lora_alpha=32, lora_dropout=0.05),
             "chat": LoRASpec(r=32, lora_alpha=32, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))}
    for name, spec in specs.items():
        add_adapter(model, name, spec, seed=0)
    gen = torch.Generator().manual_seed(0)
    samples = [(name, torch.randint(0, arch.vocab_size, (n,), generator=gen).tolist())
               for name, n in (("sql", 37), ("sql", 21), ("summarize", 64), ("chat", 29), ("chat", 45))]
    batch = pack_microbatch(samples)
    dev = next(model.parameters()).device
    batch = batch.to(dev)
    opt = torch.optim.AdamW([p for _, m in lora_modules(model) for p in list(m.lora_A.values()) + list(m.lora_B.values())],
                            lr=1e-2)
    model.train()
    for step in range(5):
        with lora_batch(model, batch.routing, batch.adapters):
            loss = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                         packed_seq_params=batch.packed_seq_params())
        parts = {}
        for name in batch.adapters:
            m = batch.adapter_token_mask(name).float() * batch.loss_mask
            parts[name] = (loss * m).sum() / m.sum()
        sum(parts.values()).backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: " + "  ".join(f"{n}={v.item():.4f}" for n, v in parts.items()))
    out = Path(args.output_dir)
    for name in specs:
        export_peft_adapter(model, name, out / "adapters" / name)
    print(f"exported {len(specs)} PEFT adapters to {out / 'adapters'} in {time.time() - t0:.1f}s "
          f"({batch.num_tokens} packed tokens, {len(samples)} samples, {len(specs)} adapters)")
    return 0


def cmd_not_yet(args) -> int:
    if getattr(args, "config", None) and not Path(args.config).is_file():
        print(f"{args.config}: file not found (expected a run YAML)", file=sys.stderr)
        return 2
    print(NOT_YET.format(cmd=args.cmd))
    if args.cmd == "train":
        print("\nRunning `lorafusion smoke` instead:\n")
        args.preset, args.output_dir = "tiny-llama", "outputs/smoke"
        return cmd_smoke(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lorafusion", description="Train many LoRA adapters of one base model at once.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the adapter jobs of a run YAML")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="key=value overrides")
    pl = sub.add_parser("plan", help="schedule a run's data and draw the plan (no model)")
    pl.add_argument("config")
    e = sub.add_parser("export", help="export one job of a checkpoint as a PEFT adapter")
    e.add_argument("checkpoint")
    e.add_argument("--job", required=True)
    e.add_argument("--out", required=True)
    s = sub.add_parser("smoke", help="tiny end-to-end run of what is built: model, 3 adapters, packed batch, export")
    s.add_argument("--preset", default="tiny-llama")
    s.add_argument("--output-dir", default="outputs/smoke")
    args = p.parse_args(argv)
    if args.cmd == "smoke":
        return cmd_smoke(args)
    return cmd_not_yet(args)


if __name__ == "__main__":
    sys.exit(main())
