"""ATen ops of one training microbatch (forward + backward) per decoder layer, grouped by call site: which
small kernels the step launches besides GEMMs, attention and our fused kernels, and where each comes from.

Builds the 8B's layer structure narrow (hidden 64, 4:1 GQA, SwiGLU) with the fused ops and LoRA kernels of a
GPU (``fused_ops="triton"``, Triton LoRA), four r=16 adapters on every linear, and runs them on the CPU
through Triton's interpreter. A warm step first (the adapters' gradients then exist, as from a step's second
microbatch on), then one step whose ops are recorded with their Python call site, or, in backward, the
autograd node that ran. Ops issued inside the interpreter (its tensor traffic) and those of the CPU-only
attention path (per-sequence SDPA, GQA expansion, slicing) are left out; what remains is what the GPU
path dispatches. Run at ``--layers`` 1 and 2 the difference is one layer's count:

    TRITON_INTERPRET=1 python scripts/aten_sites.py --layers 1 --out /tmp/l1.json
    TRITON_INTERPRET=1 python scripts/aten_sites.py --layers 2 --out /tmp/l2.json --per-layer /tmp/l1.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# views and allocations: no kernel
FREE = {"view", "_unsafe_view", "t", "detach", "empty", "as_strided", "slice", "select", "transpose",
        "expand", "unsqueeze", "squeeze", "alias", "permute", "split", "split_with_sizes", "empty_strided",
        "reshape", "unbind", "lift_fresh", "empty_like", "new_empty"}
CPU_ONLY = ("attention.py:varlen_attention_reference", "attention.py:causal_attention_reference",
            "attention.py:expand_kv", "NODE:SliceBackward0", "NODE:ExpandBackward0", "NODE:ScaledDotProduct")


class SiteRecorder(TorchDispatchMode):
    """Records (op, call site) of every dispatched op outside Triton's interpreter."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stack = traceback.extract_stack()[:-1]
        if not any("triton/runtime/interpreter" in f.filename for f in stack):
            ours = [f"{Path(f.filename).name}:{f.name}" for f in stack
                    if "lorafusion" in f.filename or "megatron" in f.filename]
            node = torch._C._current_autograd_node()
            site = f"NODE:{node.name()} <- {ours[-1] if ours else ''}" if node is not None else \
                " <- ".join(reversed(ours[-3:]))
            self.rows.append((str(func), site))
        return func(*args, **(kwargs or {}))


def build(layers: int):
    from lorafusion.core.arch import PRESETS
    from lorafusion.core.lora import LoRASpec
    from lorafusion.dist import init_distributed
    from lorafusion.layers import add_adapter
    from lorafusion.models.provider import build_model

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init_distributed(1, 1)
    arch = replace(PRESETS["llama3.1-8b"], vocab_size=512, hidden_size=64, num_layers=layers,
                   num_attention_heads=8, num_query_groups=2, ffn_hidden_size=224)
    model = build_model(arch, params_dtype=torch.bfloat16, device="cpu", seed=3, fused_ops="triton",
                        lora_impl="triton")
    for i, name in enumerate("abcd"):
        add_adapter(model, name, LoRASpec(r=16, lora_alpha=32, lora_dropout=0.1,
                                          target_modules=("all-linear",)), seed=i)
    model.train()
    return model


def step(model, mb) -> None:
    from lorafusion.layers import set_batch

    set_batch(model, mb.routing, mb.adapters, list(range(len(mb.adapters))))
    per_token = model(mb.tokens, mb.position_ids, attention_mask=None, labels=mb.labels,
                      packed_seq_params=mb.packed_seq_params())
    ((per_token.float() * mb.loss_mask).sum() / mb.loss_mask.sum()).backward()
    set_batch(model, None, ())


def site_counts(layers: int) -> collections.Counter:
    """(op @ site) -> count over one recorded microbatch of a ``layers``-layer model."""
    from lorafusion.data import pack_microbatch

    model = build(layers)
    gen = torch.Generator().manual_seed(0)
    mb = pack_microbatch([(n, torch.randint(0, 512, (k,), generator=gen).tolist())
                          for n, k in zip("abcd", (37, 21, 40, 30))], row_ids=[0, 1, 2, 3])
    step(model, mb)
    rec = SiteRecorder()
    with rec:
        step(model, mb)
    return collections.Counter(f"{op} @ {site}" for op, site in rec.rows
                               if op.split(".")[1] not in FREE and not any(c in site for c in CPU_ONLY))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--out", help="write the counts per (op, site) here (JSON)")
    ap.add_argument("--per-layer", help="a --out of a run with one layer fewer: print the difference")
    args = ap.parse_args()
    counts = site_counts(args.layers)
    if args.out:
        Path(args.out).write_text(json.dumps(counts, indent=1))
    base = collections.Counter(json.loads(Path(args.per_layer).read_text())) if args.per_layer else None
    shown = {k: n - base.get(k, 0) for k, n in counts.items()} if base is not None else dict(counts)
    for key, n in sorted(shown.items(), key=lambda kv: -kv[1]):
        if n:
            print(f"{n:5d}  {key}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
