"""The GPU a run trains on, as far as memory goes: its free memory read at start (the smallest over the ranks,
so every rank resolves the same plan: :func:`lorafusion.resolve.resolve`), the plan printed, and a runtime
out-of-memory turned into one clear error. Without CUDA there is no memory limit to read (None)."""

from __future__ import annotations

import sys

import torch

from lorafusion.resolve import GpuMemory, MemoryFitError, RunPlan
from lorafusion.scheduler.memory import GIB, load_coefficients
from lorafusion.scheduler.sizing import oom_advice

__all__ = ["check_fit", "gpu_free_bytes", "gpu_memory", "oom_error"]


def gpu_free_bytes() -> tuple[float, float] | None:
    """(free, total) bytes of this rank's GPU, the free part the smallest over all ranks; None without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    from lorafusion.dist import min_over_ranks, warm_communicators

    # NCCL's buffers live outside torch's allocator: take them before reading what is free
    warm_communicators()
    free, total = torch.cuda.mem_get_info()
    return float(min_over_ranks(free)), float(total)


def gpu_memory() -> GpuMemory | None:
    """:func:`gpu_free_bytes` as the ``gpu`` argument of :func:`lorafusion.resolve.resolve`."""
    got = gpu_free_bytes()
    return None if got is None else GpuMemory(*got)


def check_fit(plan: RunPlan, *, is_logger: bool) -> None:
    """Print the plan (with a GPU) and refuse one that does not fit where the run chose its settings
    (:class:`MemoryFitError`); settings given and predicted not to fit are only warned about (the prediction
    errs on the safe side)."""
    if not plan.fits and {"token_capacity", "recompute_layers"} & set(plan.auto):
        raise MemoryFitError(plan.no_fit)
    if is_logger and plan.memory is not None:
        lines = plan.lines()
        print(f"lorafusion: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:  # (a plan that does not fit ends with why: a warning, the run goes on)
            print(line, file=sys.stderr)


def oom_error(plan: RunPlan, stage: int, chunk: int) -> MemoryFitError:
    """The one-line error for a ``torch.OutOfMemoryError`` while training ``chunk`` on pipeline ``stage``."""
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")
    total = torch.cuda.mem_get_info()[1] / GIB if torch.cuda.is_available() else float("nan")
    msg = (f"{plan.source}: pipeline stage {stage} ran out of GPU memory in chunk {chunk}: {peak:.1f} GiB "
           f"allocated at the peak of {total:.1f} GiB")
    fixes = []
    if plan.memory is not None:
        s = plan.memory.stages[stage]
        msg += (f" (the memory model predicted a peak of {s.peak / GIB:.1f} GiB at token_capacity "
                f"{plan.token_capacity} with {s.recompute_layers} of {s.layers} layers recomputed)")
        fixes = oom_advice(plan.setup, plan.memory, stage, peak * GIB, plan.longest, load_coefficients())
    msg += (". The memory model, corrected by this stage's miss, fits: " + "; or ".join(fixes) if fixes else
            ". Nothing in reach of the memory model fits: more pipeline stages, tensor parallelism or "
            "shorter samples (dataset.max_seq_len with truncate: true)")
    msg += "; checkpoints already written are intact"
    return MemoryFitError(msg)
