"""Host work of one multi-adapter LoRA linear's forward + backward on the Triton path (``impl="triton"``).

Builds one decoder layer of the 8B's structure at a narrow width (hidden 64, 4:1 grouped-query attention,
SwiGLU) with four r=16 adapters on every linear (as configs/llama3.1-8b-4adapters.yaml), routes a packed
microbatch of four segments to them and runs each LoRA linear's forward and backward, counting per call:

- ATen ops that reach the dispatcher (forward and backward; those the Triton interpreter issues to run a
  kernel body on the CPU are not counted),
- Triton kernel launches,
- cProfile own time of lorafusion's Python (the kernel bodies, which the interpreter runs as Python, are
  left out; so is everything outside lorafusion/).

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here when no GPU is present);
the counts are those of the GPU path, the times are not (the interpreter's launch is not the GPU's).

    python scripts/bench_lora_host.py [--calls 5] [--tokens 256] [--json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_KERNEL_BODIES = ("kernels/fused_lora.py", "kernels/dropout.py", "kernels/fp8_quant.py")


class Counter(TorchDispatchMode):
    """ATen ops below autograd, and Triton launches (the ops a launch issues itself are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.launches = 0
        self.paused = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops += 1
            self.names[str(func)] = self.names.get(str(func), 0) + 1
            if os.environ.get("BENCH_TRACE_OP") == str(func):
                import traceback

                traceback.print_stack(limit=8)
        return func(*args, **(kwargs or {}))


_ACTIVE: list[Counter] = []


def _patch_launches(no_kernels: bool = False) -> None:
    """Count every Triton launch (JIT or interpreted) in the innermost active counter; ``no_kernels``: the
    interpreter runs no kernel body (outputs stay uninitialised; only the host work is left)."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    def wrap(cls):
        orig = (lambda *a, **k: None) if no_kernels and cls is interp.InterpretedFunction else cls.run

        def run(self, *args, **kwargs):
            c = _ACTIVE[-1] if _ACTIVE else None
            if c is None:
                return orig(self, *args, **kwargs)
            c.launches += 1
            c.paused += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                c.paused -= 1

        cls.run = run

    wrap(interp.InterpretedFunction)
    wrap(jit.JITFunction)
    try:  # the launch fast path, where there is one: a cached kernel launched directly
        from lorafusion.kernels import launch as fast

        orig = fast.Launcher._direct

        def direct(self, *args, **kwargs):
            if _ACTIVE:
                _ACTIVE[-1].launches += 1
            return orig(self, *args, **kwargs)

        fast.Launcher._direct = direct
    except (ImportError, AttributeError):
        pass


def build(tokens: int, hidden: int):
    from lorafusion.core.arch import PRESETS
    from lorafusion.core.lora import LoRASpec
    from lorafusion.dist import init_distributed
    from lorafusion.layers import add_adapter, lora_modules
    from lorafusion.models.provider import build_model

    init_distributed(1, 1)
    arch = replace(PRESETS["llama3.1-8b"], vocab_size=512, hidden_size=hidden, num_layers=1,
                   num_attention_heads=8, num_query_groups=2, ffn_hidden_size=hidden * 7 // 2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(arch, params_dtype=torch.bfloat16, lora_impl="triton", device=dev, seed=1)
    spec = LoRASpec(r=16, lora_alpha=32, lora_dropout=0.1, target_modules=("all-linear",))
    names = ["short", "medium", "long", "mixed"]
    for n in names:
        add_adapter(model, n, spec, seed=3)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for p in mod.lora_B.values():
                p.normal_(0, 0.02)
    model.train()
    return model, names, dev


def run_linear(model, mod, names, tokens, dev, calls):
    """(per-call ATen ops, launches, own ms of lorafusion's Python, op names of one call)."""
    from lorafusion.core.routing import Routing
    from lorafusion.layers import lora_batch

    q = tokens // 4
    lens = [q + 3, q - 5, q + 7, tokens - 3 * q - 5]
    in_size = mod.input_size_per_partition if hasattr(mod, "input_size_per_partition") else mod.input_size
    x = torch.randn(tokens, 1, in_size, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def one(i, counter=None, prof=None, timed=False):
        """A microbatch: the linear runs once to build the microbatch's tables (as the model's first LoRA
        linear does for all 128), then once measured, as every other linear of the microbatch runs."""
        routing = Routing.from_lengths([0, 1, 2, 3], lens, row_ids=list(range(tokens)))
        with lora_batch(model, routing, names, seeds=[11 + i, 12 + i, 13 + i, 14 + i]):
            out, _ = mod(x)
            out.backward(dy)
            model.zero_grad(set_to_none=True)
            x.grad = None
            if counter is not None:
                _ACTIVE.append(counter)
                counter.__enter__()
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            out, _ = mod(x)
            out.backward(dy)
            wall = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            if counter is not None:
                counter.__exit__(None, None, None)
                _ACTIVE.pop()
            model.zero_grad(set_to_none=True)
            x.grad = None
        return wall

    out, _ = mod(x)
    dy = torch.randn_like(out)
    del out
    one(0)  # compile, caches
    c = Counter()
    one(1, counter=c)
    owns, funcs, walls = [], {}, []
    for i in range(calls):  # the median call: the interpreter's garbage makes single calls noisy
        prof = cProfile.Profile()
        one(2 + i, prof=prof)
        walls.append(one(2 + i, timed=True))
        own = 0.0
        for (file, line, fn), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
            if "lorafusion/" in file and not any(file.endswith(k) for k in _KERNEL_BODIES):
                own += tt
                name = f"{Path(file).name}:{line}:{fn}"
                funcs.setdefault(name, []).append(tt)
        owns.append(own)
    top = sorted(((statistics.median(v + [0.0] * (calls - len(v))), f) for f, v in funcs.items()),
                 reverse=True)
    return (c.ops, c.launches, 1e3 * statistics.median(owns), c.names,
            [(round(1e3 * t, 3), f) for t, f in top[:12]], 1e3 * statistics.median(walls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--calls", type=int, default=7, help="profiled calls per linear")
    ap.add_argument("--ops", action="store_true", help="print each linear's ATen ops by name")
    ap.add_argument("--top", action="store_true", help="print each linear's wrapper functions by own time")
    ap.add_argument("--no-kernels", action="store_true",
                    help="(CPU) the interpreter runs no kernel body: the wall time is the host work alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _patch_launches(args.no_kernels)
    from lorafusion.layers import lora_modules

    model, names, dev = build(args.tokens, args.hidden)
    mods = dict(lora_modules(model))
    rows = {}
    for kind in KINDS:
        ops, launches, own_ms, opnames, top, wall = run_linear(model, mods[f"1.{kind}"], names, args.tokens,
                                                                dev, args.calls)
        rows[kind] = {"aten_ops": ops, "launches": launches, "own_ms": round(own_ms, 3),
                      "wall_ms": round(wall, 3)}
        print(f"{kind:12s} ATen ops {ops:4d}  Triton launches {launches:3d}  lorafusion own time "
              f"{own_ms:7.3f} ms (cProfile)  wall {wall:7.3f} ms per fwd+bwd (medians)")
        if args.ops:
            print("   ", dict(sorted(opnames.items(), key=lambda kv: -kv[1])))
        if args.top:
            for t, f in top:
                print(f"      {t:8.3f} ms  {f}")
    layer = {k: sum(r[k] for r in rows.values()) for k in ("aten_ops", "launches", "own_ms", "wall_ms")}
    print(f"per layer (4 linears): {layer['aten_ops']} ATen ops, {layer['launches']} launches, "
          f"{layer['own_ms']:.2f} ms own, {layer['wall_ms']:.2f} ms wall; x32 layers (8B, 128 linears): "
          f"{32 * layer['aten_ops']} ops, {32 * layer['launches']} launches")
    if args.json:
        print(json.dumps({"linears": rows, "layer": layer, "tokens": args.tokens, "hidden": args.hidden}))


if __name__ == "__main__":
    main()
