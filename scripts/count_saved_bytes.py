"""Count the bytes autograd saves for backward per token, on CPU, through the model code the GPU runs.

    TRITON_INTERPRET=1 python scripts/count_saved_bytes.py [--adapters 4,12] [--capacities 128,256]

Builds a reduced-width decoder with the 8B's ratios (hidden 512, ffn 1792, 8 heads of 64, 2 query groups: 4
heads a group as the 8B's 32/8) through ``lorafusion.models.provider.build_model`` with the GPU's fused ops
and Triton LoRA kernels (interpreted on the CPU; ``fused_ops="torch"`` would not do: ``F.rms_norm`` keeps an
fp32 copy of its input), adds LoRA adapters as ``scripts/calibrate_memory.py`` does (r=16, all-linear, dropout
0.1, an A per projection), packs a microbatch with its ``_batch`` (mixed sample lengths, contiguous per
adapter), runs the forward under ``torch.autograd.graph.saved_tensors_hooks`` and counts each saved storage
once (by data pointer; the frozen weights left out). Two capacities give the bytes per token: their difference
over the token difference, printed beside what the memory model counts per token at ``act_scale`` 1
(``memory.saved_elems`` + ``memory.lora_elems`` per layer, and the last stage's three hidden-size loss
tensors).

``--attention`` chooses the core attention: ``per-sample`` is the path a CPU (and a GPU after
``varlen_attn`` failed) takes — one SDPA per sample, outputs concatenated; ``varlen`` stands in for the
GPU's FlashAttention varlen op with what ``torch.nn.attention.varlen``'s autograd saves (q, k, v, cu_seqlens,
out, lse [heads, tokens] fp32), k and v expanded to the query heads first as models/attention.py does for a
torch without ``enable_gqa`` (2.11, the GPU image's); ``--varlen-gqa`` keeps them grouped. One JSON line per
(adapters, attention). A run of the defaults takes a few minutes (the interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


class _VarlenLike:
    """An autograd Function saving what torch's varlen_attn saves; the values come from the exact
    reference."""

    @staticmethod
    def make(gqa: bool):
        import torch

        from lorafusion.models import attention as att

        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, cu, scale):
                with torch.no_grad():
                    out = att.varlen_attention_reference(q, k, v, cu, scale)
                lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
                ctx.save_for_backward(q, k, v, cu, cu, out, lse)
                return out

            @staticmethod
            def backward(ctx, dout):  # not needed to count; kept exact for completeness
                raise NotImplementedError

        def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale):
            if not gqa:
                k, v = att.expand_kv(k, q.shape[1], 1), att.expand_kv(v, q.shape[1], 1)
            return F.apply(q, k, v, cu_seqlens.to(torch.int32), scale)

        return varlen_attention


def _saved_bytes(model, batch, dtype) -> int:
    import torch

    from lorafusion.layers import set_batch

    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    set_batch(model, batch.routing, batch.adapters, [7] * len(batch.adapters))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch.tokens, batch.position_ids, attention_mask=None, labels=batch.labels,
                     packed_seq_params=batch.packed_seq_params())
    del loss
    set_batch(model, None, ())
    return sum(n for p, n in seen.items() if p not in params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", default="4,12")
    ap.add_argument("--capacities", default="128,256")
    ap.add_argument("--attention", default="per-sample,varlen")
    ap.add_argument("--varlen-gqa", action="store_true")
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()

    import torch

    import calibrate_memory as cm  # noqa: E402 (scripts/ on the path above)
    from lorafusion.core.arch import ModelArch
    from lorafusion.dist import init_distributed
    from lorafusion.layers import get_lora_context
    from lorafusion.models import attention as att
    from lorafusion.models.provider import build_model
    from lorafusion.scheduler.memory import AdapterShape, MemorySetup, lora_elems, saved_elems

    init_distributed(1, 1, seed=1)
    dtype = torch.float16  # a 2-byte dtype the CPU runs (bf16 tl.dot is wrong in the Triton interpreter)
    arch = ModelArch("llama", vocab_size=1024, hidden_size=512, num_layers=args.layers, num_attention_heads=8,
                     num_query_groups=2, ffn_hidden_size=1792)
    model = build_model(arch, params_dtype=dtype, fused_ops="triton", seed=1, lora_impl="triton")
    model.train()
    per_sample = att.varlen_attention
    caps = [int(c) for c in args.capacities.split(",")]
    out = []
    for n in (int(a) for a in args.adapters.split(",")):
        cm._attach(model, n, 16)
        for mode in args.attention.split(","):
            path = "varlen-gqa" if mode == "varlen" and args.varlen_gqa else mode
            setup = MemorySetup(arch,
                                tuple(AdapterShape(16, dropout=0.1, independent_a=True) for _ in range(n)),
                                attention=path)
            counted = 2 * (arch.num_layers * (saved_elems(setup) + lora_elems(setup)) + 3 * arch.hidden_size)
            att.varlen_attention = per_sample if mode == "per-sample" else _VarlenLike.make(args.varlen_gqa)
            sizes = {c: _saved_bytes(model, cm._batch(c, list(get_lora_context(model).specs),
                                                      arch.vocab_size, 0), dtype)
                     for c in caps}
            slope = (sizes[caps[-1]] - sizes[caps[0]]) / (caps[-1] - caps[0])
            rec = dict(attention=path, adapters=n, layers=arch.num_layers, saved_bytes=sizes,
                       bytes_per_token=round(slope, 1), model_bytes_per_token=counted)
            out.append(rec)
            print(json.dumps(rec), flush=True)
    att.varlen_attention = per_sample


if __name__ == "__main__":
    main()
