"""Host work of one LoRA linear's forward + backward: the FP8 base (``ops.fp8_lora``) against the bf16 base
(``ops.fused``, main GEMM "cublas"), counted on a CPU with the Triton kernels in Triton's interpreter.

Per linear call (forward + backward, after a warm-up call that built the microbatch's tables):

- ATen ops: every op that reaches the dispatcher outside a kernel launch (on a GPU each is host work, most of
  them a CUDA launch or an allocation); the interpreter's own copies inside a launch are not counted;
- Triton launches, by kernel;
- own time: cProfile's summed own time of lorafusion's functions, the interpreted kernel bodies excluded, the
  least of ``--repeat`` calls (a CPU number: only its relative size means something); the functions listed
  by their mean.

The CUDA path is what is counted: the FP8 row quantization and the weight transpose run their Triton kernels
(``quantize_rows_triton`` / ``transposed_operand``, on the CPU through the interpreter, which does not round
float→fp8 to nearest: counts only, no numbers), and ``torch._scaled_mm`` runs on the CPU. "fp8" is the
shipped form (W_q's transpose made in each backward), "fp8-kept" keeps it (``fp8_base.KEEP_TRANSPOSED``).

    TRITON_INTERPRET=1 python scripts/bench_fp8_linear_host.py [--m 64 --k 64 --n 64 --adapters 4 --r 16]

Last line: JSON.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Counter(TorchDispatchMode):
    """ATen ops dispatched outside a Triton launch, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class Launches:
    """Patches the interpreter's launch: counts launches by kernel, pauses the op counter and the profiler
    inside (the kernel body is GPU work on a GPU)."""

    def __init__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.cls, self.real = InterpretedFunction, InterpretedFunction.run
        self.by_kernel: collections.Counter = collections.Counter()
        self.counter: Counter | None = None
        self.prof: cProfile.Profile | None = None
        outer = self

        def run(fn_self, *args, **kwargs):
            outer.by_kernel[fn_self.fn.__name__] += 1
            if outer.prof is not None:
                outer.prof.disable()
            if outer.counter is not None:
                outer.counter.paused += 1
            try:
                return outer.real(fn_self, *args, **kwargs)
            finally:
                if outer.counter is not None:
                    outer.counter.paused -= 1
                if outer.prof is not None:
                    outer.prof.enable()

        InterpretedFunction.run = run


def force_cuda_path() -> None:
    """The FP8 helpers take their CUDA (Triton) branch on CPU tensors too."""
    from lorafusion.ops import fp8_linear as F

    F._on_device = lambda t: True  # the helpers' one test of the device


def case(args, seed=0):
    from lorafusion.core.routing import Routing
    from lorafusion.core.seeds import mix_seed
    from lorafusion.ops import fp8_linear as F

    g = torch.Generator().manual_seed(seed)
    m, k, n, na, r = args.m, args.k, args.n, args.adapters, args.r
    x = torch.randn(m, k, generator=g).to(torch.float16).requires_grad_(True)
    w = torch.randn(n, k, generator=g) * 0.05
    w_q, w_s = F.quantize_weight(w)
    A = [(torch.randn(r, k, generator=g) / k ** 0.5).requires_grad_(True) for _ in range(na)]
    B = [(torch.randn(n, r, generator=g) * 0.1).requires_grad_(True) for _ in range(na)]
    step = m // na
    routing = Routing(segments=tuple((a, a * step, step) for a in range(na)), num_rows=m)
    seeds = [mix_seed(seed, a) for a in range(na)]
    dy = torch.randn(m, n, generator=g).to(torch.float16)
    return dict(x=x, w=w.to(torch.float16), w_q=w_q, w_s=w_s, A=A, B=B, sc=[2.0] * na, ps=[0.1] * na,
                seeds=seeds, routing=routing, seed_table=torch.tensor(seeds), dy=dy)


def call(path: str, c, cache, weight_form):
    from lorafusion.ops.fp8_lora import fp8_multi_lora_linear
    from lorafusion.ops.fused import multi_lora_linear_fused

    common = (c["A"], c["B"], c["sc"], c["ps"], c["seeds"], c["routing"])
    if weight_form is not None:
        y = fp8_multi_lora_linear(c["x"], weight_form.q, weight_form.scale, None, *common, cache=cache,
                                  seed_table=c["seed_table"], form=weight_form)
    else:
        y = multi_lora_linear_fused(c["x"], c["w"], None, *common, cache=cache, seed_table=c["seed_table"],
                                    main_gemm="cublas")
    y.backward(c["dy"])


def measure(path: str, args, launches: Launches) -> dict:
    from lorafusion.ops import fp8_linear as F
    from lorafusion.ops.tables import TableCache

    c = case(args)
    cache = TableCache()
    form = None
    if path != "bf16":  # the layer's weight form: made once per weight (fp8_base.weight_form)
        form = F.Fp8Weight(c["w_q"], c["w_s"], transposed=path == "fp8-kept")
    call(path, c, cache, form)  # tables built, kernels interpreted once
    launches.by_kernel.clear()
    counter = Counter()
    launches.counter = counter
    with counter:
        call(path, c, cache, form)
    launches.counter = None
    kernels = dict(launches.by_kernel)
    totals, own = [], collections.Counter()
    for _ in range(args.repeat):  # each call profiled alone: the least total is the least disturbed
        prof = cProfile.Profile()
        launches.prof = prof
        prof.enable()
        call(path, c, cache, form)
        prof.disable()
        launches.prof = None
        mine = {f"{Path(fn[0]).name}:{fn[2]}": tt for fn, (_, _, tt, _, _) in pstats.Stats(prof).stats.items()
                if "lorafusion" in fn[0]}
        totals.append(sum(mine.values()))
        own.update({k: v / args.repeat for k, v in mine.items()})
    top = sorted(own.items(), key=lambda kv: -kv[1])[:args.top]
    return {"path": path, "aten_ops": sum(counter.ops.values()), "launches": sum(kernels.values()),
            "by_kernel": kernels, "ops": dict(counter.ops.most_common()), "own_ms": min(totals) * 1e3,
            "top_own_ms": {k: round(v * 1e3, 4) for k, v in top}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--ops", action="store_true", help="print the ATen ops by name")
    args = ap.parse_args()
    force_cuda_path()
    launches = Launches()
    rows = [measure(p, args, launches) for p in ("bf16", "fp8", "fp8-kept")]
    for row in rows:
        print(f"{row['path']}: {row['aten_ops']} ATen ops, {row['launches']} Triton launches "
              f"{row['by_kernel']}, own time {row['own_ms']:.2f} ms (CPU, cProfile)")
        for name, ms in row["top_own_ms"].items():
            print(f"    {ms:8.4f} ms  {name}")
        if args.ops:
            for name, n in row["ops"].items():
                print(f"    {n:4d}  {name}")
    print(json.dumps({r["path"]: {k: r[k] for k in ("aten_ops", "launches", "by_kernel", "ops", "own_ms")}
                      for r in rows}))


if __name__ == "__main__":
    main()
