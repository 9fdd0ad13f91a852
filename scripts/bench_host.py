"""Host time per microbatch: the Python, dispatch and launch work of a training step, measured where the
math costs almost nothing.

A training run whose microbatches are small (a few thousand tokens on one GPU, or split over TP ranks) is
bound by how fast the host issues kernels, not by the GPU. This runs the real trainer (``lorafusion train``'s
code: planning, packing, the Megatron schedule, the LoRA layers, the optimizer steps) on a model of the
8B's structure — its 32 decoder layers, 4:1 grouped-query attention, SwiGLU, four r=16 adapters on every
linear — at a width so narrow (hidden 64) that the arithmetic is a small part of each step, so the time per
microbatch is the host's. The same ops are issued as on the GPU (the torch LoRA path stands in for the
Triton kernels on a CPU).

    python scripts/bench_host.py                             # one process
    python scripts/bench_host.py --cprofile 25               # + the 25 functions with most own time
    python -m torch.distributed.run --nproc_per_node 2 scripts/bench_host.py \\
        parallelism.tp=2 parallelism.sequence_parallel=true  # TP=2 + SP on gloo

Prints ms per microbatch (median over the timed chunks), ATen ops per microbatch (what reaches the
dispatcher: on a GPU, roughly the kernels launched) and µs per op; rank 0 alone. Last line: JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ROOT, ensure_data  # noqa: E402

PRESET = "llama3.1-8b-narrow"
RANK = int(os.environ.get("RANK", "0"))


def register_preset(hidden: int, layers: int) -> None:
    """The 8B's structure at ``hidden`` width (heads and FFN scaled with it, a byte-sized vocabulary)."""
    from lorafusion.core.arch import PRESETS

    PRESETS[PRESET] = replace(PRESETS["llama3.1-8b"], vocab_size=512, hidden_size=hidden, num_layers=layers,
                              num_attention_heads=8, num_query_groups=2, ffn_hidden_size=hidden * 7 // 2)


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops that reach the dispatcher below autograd (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class HostClock:
    """A trainer callback: after ``first`` warm-up chunks, one chunk under the op counter, then ``timed``
    chunks timed (wall time and microbatches of each), then, with a profiler, one chunk under cProfile (its
    overhead kept out of the timed chunks)."""

    def __init__(self, first: int, timed: int, prof: cProfile.Profile | None):
        self.first, self.timed, self.prof, self.calls = first, timed, prof, 0
        self.rows: list[tuple[float, int]] = []
        self.ops = None
        self._t0 = self._counter = None

    def chunk_start(self, trainer, chunk):
        self.calls += 1
        i = self.calls - self.first  # 1: op count, 2..timed+1: timed, timed+2: cProfile
        if i == 1:
            self._counter = OpCounter()
            self._counter.__enter__()
        elif i == self.timed + 2 and self.prof is not None:
            self.prof.enable()
        self._t0 = time.perf_counter() if 2 <= i <= self.timed + 1 else None

    def chunk_ran(self, trainer, chunk, result):
        n = len(chunk.packed)
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.ops, self._counter = self._counter.count / max(n, 1), None
        elif self._t0 is not None:
            self.rows.append((time.perf_counter() - self._t0, n))
            self._t0 = None
        elif self.prof is not None:
            self.prof.disable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/llama3.1-8b-4adapters.yaml")
    ap.add_argument("--hidden", type=int, default=None if torch.cuda.is_available() else 64,
                    help="the narrow model's width (default on a CPU: 64); on a GPU the config's own model "
                         "unless given")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096 if torch.cuda.is_available() else 2048,
                    help="token_capacity (samples cut to it)")
    ap.add_argument("--chunks", type=int, default=4, help="timed chunks (one global batch per job each)")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="print this many functions by own time (one more chunk, under cProfile)")
    ap.add_argument("--out", help="the run's output directory (default: a new temporary one)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host's pace, not the CPU's parallel math
    ensure_data(256)
    from bench_train import run_lorafusion
    from lorafusion.config import load_run_config

    jobs = len(load_run_config(ROOT / args.config).jobs)
    over = ["model.recompute=false", "model.recompute_layers=null", f"scheduler.token_capacity={args.tokens}",
            "scheduler.lookahead_batches=1"]
    if args.hidden:
        register_preset(args.hidden, args.layers)
        over += [f"model.preset={PRESET}", "model.dtype=float32"]
    over += [f"jobs.{i}.{k}" for i in range(jobs)
             for k in (f"dataset.max_seq_len={args.tokens}", "dataset.truncate=true", "global_batch_size=4")]
    over += list(args.overrides)
    prof = cProfile.Profile() if args.cprofile and RANK == 0 else None
    warm = 2  # chunks: compilation, caches and the first allocations
    clock = HostClock(warm, args.chunks, prof)
    res = run_with(run_lorafusion, args, over, warm, clock)
    if RANK != 0:
        return
    per_mb = [1e3 * dt / n for dt, n in clock.rows if n]
    out = {"ms_per_microbatch": statistics.median(per_mb),
           "ms_per_microbatch_all": [round(x, 2) for x in per_mb],
           "aten_ops_per_microbatch": clock.ops,
           "us_per_op": 1e3 * statistics.median(per_mb) / clock.ops if clock.ops else None,
           "tokens_per_s": res.get("tokens_per_s"), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
           "hidden": args.hidden, "layers": args.layers, "tokens": args.tokens, "overrides": args.overrides}
    print(f"host: {out['ms_per_microbatch']:.1f} ms per microbatch (median of {len(per_mb)} chunks), "
          f"{clock.ops or 0:.0f} ATen ops per microbatch, {out['us_per_op'] or 0:.1f} µs per op")
    if prof is not None:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(args.cprofile)
        st.sort_stats("cumulative").print_stats(r"lorafusion|megatron", args.cprofile)
        print(s.getvalue())
    print(json.dumps(out))


def run_with(run_lorafusion, args, over, warm, clock) -> dict:
    """bench_train's trainer run with the host clock among its callbacks (the run's ``profiler`` slot takes
    any trainer callback)."""
    # (every rank runs the profiled chunk: rank 0 alone profiles it, the others must take part in it)
    steps = warm + 1 + args.chunks + (1 if args.cprofile else 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # (one directory for all ranks of a torchrun launch)
    out = Path(args.out or (Path(tempfile.gettempdir()) / f"bench_host_{run_id}" if run_id
                            else tempfile.mkdtemp(prefix="bench_host_")))
    res, _, _ = run_lorafusion(args.config, over, steps, warm, out, profiler=clock, background=True)
    return res


if __name__ == "__main__":
    main()
