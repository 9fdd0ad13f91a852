"""The timer and the record writer every benchmark script here shares.

Timing: device work is asynchronous, so a GPU call is bracketed by CUDA events (synchronized before and
after); on a CPU the host clock times it. :func:`median_ms` runs ``warmup`` untimed calls first (Triton JIT,
cuBLAS heuristics and allocator growth stay out of the numbers), then ``iters`` timed ones, and returns their
median.

Records: :func:`run_info` is what every result JSON carries so that a number can be traced back — the device,
the commit (``BENCH_COMMIT``, else a ``.commit`` file at the repository root for a tree copied without its git
directory, else ``git rev-parse``), the command line (``BENCH_COMMAND`` when a wrapper knows it better) and
the date. :func:`write_json` writes the record to ``--out`` and prints it as the last line of the output.

torch is imported only by the functions that need it, so the torch-free benchmarks (scheduler, online
simulation) use this module too.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# GPU kernels by family (profile summaries; :func:`family`): the first family whose key is in the kernel's
# name, lower case, wins (the LoRA kernels before GEMMs: "_lora_gemm" holds "gemm")
FAMILIES = (("NCCL", ("nccl",)),
            ("LoRA (Triton)", ("_lora_gemm", "_shrink", "_ds_db", "_da_dx", "_da_kernel")),
            ("attention (flash)", ("flash",)),
            ("gemm (cuBLAS)", ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas")),
            ("loss / norm / SwiGLU / RoPE (Triton)", ("liger", "_rms", "swiglu", "silu", "rope",
                                                       "cross_entropy", "triton", "_fwd", "_bwd")),
            ("copies", ("memcpy", "memset", "copy", "cat")),
            ("reductions / elementwise (ATen)", ("reduce", "elementwise", "vectorized", "at::native")))


def family(name: str) -> str:
    """The :data:`FAMILIES` entry of a kernel name, else "other"."""
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def _cuda() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def timed_ms(fn) -> float:
    """Milliseconds of one call of ``fn``: CUDA events around it on a GPU, the host clock on a CPU."""
    if not _cuda():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    return statistics.median(timed_ms(fn) for _ in range(iters))


def device_name() -> str:
    """The GPU's name, or ``cpu`` (also when the script never imported torch)."""
    if not _cuda():
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def commit() -> str | None:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    if (ROOT / ".commit").is_file():
        return (ROOT / ".commit").read_text().strip() or None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def command() -> str:
    if os.environ.get("BENCH_COMMAND"):
        return os.environ["BENCH_COMMAND"]
    return "python " + shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def run_info() -> dict:
    """``device``, ``commit``, ``command`` and ``date`` of this run."""
    return {"device": device_name(), "commit": commit(), "command": command(),
            "date": time.strftime("%Y-%m-%d")}


def write_json(rec: dict, out: str | os.PathLike | None, indent: int = 2) -> None:
    """Write ``rec`` to ``out`` (when given) and print it as one JSON line, the last line of the output."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rec, indent=indent) + "\n")
    print(json.dumps(rec), flush=True)
