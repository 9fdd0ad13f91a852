"""The run's memory plan on the GPU it runs on: ``token_capacity: auto`` / ``recompute_layers: auto`` resolved
from the free memory read at start (the smallest over the ranks, so every rank plans the same), the plan
printed and recorded, and a runtime out-of-memory turned into one clear error.

The model and the choice are torch-free (:mod:`lorafusion.scheduler.memory`, :mod:`lorafusion.scheduler.sizing`);
``lorafusion plan --gpu-memory`` prints the same plan without a GPU. On a machine without CUDA there is no
memory limit to read: ``auto`` keeps its CPU meaning (the cost model's capacity; every layer recomputed).
"""

from __future__ import annotations

import sys

import torch

from lorafusion.scheduler.memory import GIB, load_coefficients
from lorafusion.scheduler.sizing import (
    MemoryFitError,
    MemoryPlan,
    choose,
    layers_per_stage,
    oom_advice,
    run_arch,
    no_fit_message,
    setup_from_run,
)

__all__ = ["MemoryFitError", "gpu_free_bytes", "oom_error", "recompute_kwargs", "size_run"]


def gpu_free_bytes() -> tuple[float, float] | None:
    """(free, total) bytes of this rank's GPU, the free part the smallest over all ranks; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from lorafusion.dist import min_over_ranks, warm_communicators

    warm_communicators()  # NCCL's buffers live outside torch's allocator: take them before reading what is free
    free, total = torch.cuda.mem_get_info()
    return float(min_over_ranks(free)), float(total)


def _recompute_setting(cfg, layers: list[int]) -> int | list[int] | str:
    m = cfg.model
    if m.recompute_layers == "auto":
        return "auto"
    if not m.recompute:
        return 0
    return m.recompute_layers if m.recompute_layers is not None else list(layers)


def _chunk_tokens(cfg, jobs) -> float:
    """Tokens of one planned chunk (every job's ``lookahead_batches`` global batches at its mean length)."""
    look = cfg.scheduler.lookahead_batches
    return sum(js.mean_len * js.cfg.global_batch_size * look for js in jobs.values())


def size_run(cfg, arch, jobs, *, is_logger: bool, memory: tuple[float, float] | None = None) -> MemoryPlan | None:
    """Resolve ``auto`` in place (``cfg.scheduler.token_capacity`` becomes the chosen integer) and return the
    plan; None without CUDA. Raises :class:`MemoryFitError` when an ``auto`` setting finds nothing that fits;
    a fixed setting predicted not to fit is only warned about (the prediction errs on the safe side)."""
    memory = memory or gpu_free_bytes()
    if memory is None:
        return None
    free, total = memory
    setup = setup_from_run(cfg, arch, dp=cfg.parallelism.dp if isinstance(cfg.parallelism.dp, int) else 1)
    layers = [setup.layers(k) for k in range(setup.pp)]
    longest = {n: js.cfg.dataset.max_seq_len for n, js in jobs.items()}
    plan = choose(setup, free, max(longest.values(), default=1), capacity=cfg.scheduler.token_capacity,
                  recompute=_recompute_setting(cfg, layers), coeffs=load_coefficients(),
                  chunk_tokens=_chunk_tokens(cfg, jobs), split=cfg.parallelism.stage_layers)
    auto = any(plan.chosen.values())
    if not plan.fits and auto:
        raise MemoryFitError(no_fit_message(setup, plan, longest, cfg.source, load_coefficients()))
    cfg.scheduler.token_capacity = plan.capacity
    if plan.stage_layers is not None:  # the memory-balanced split (one model chunk per rank)
        cfg.parallelism.stage_layers = list(plan.stage_layers)
    if is_logger:
        said = [f"token_capacity {plan.capacity}{' (auto)' if plan.chosen['token_capacity'] else ''}",
                f"recompute_layers per stage {plan.recompute_layers}"
                f"{' (auto)' if plan.chosen['recompute_layers'] else ''}"]
        if plan.stage_layers is not None:
            said.append(f"stage_layers {plan.stage_layers} (auto, balanced with the recompute)")
        print(f"lorafusion: memory plan for {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB per GPU: "
              + ", ".join(said), file=sys.stderr)
        for line in plan.lines():
            print("  " + line, file=sys.stderr)
        for line in plan.why():
            print("  beat " + line, file=sys.stderr)
        if not plan.fits:
            print(f"lorafusion: warning: {no_fit_message(setup, plan, longest, cfg.source, load_coefficients())}",
                  file=sys.stderr)
    return plan


def recompute_kwargs(cfg, plan: MemoryPlan | None, stage: int, arch) -> dict:
    """``recompute`` / ``recompute_layers`` for this stage's model: the plan's count for ``auto`` (none: no
    recompute; all: every layer), the config's otherwise; ``auto`` without a plan (CPU) recomputes every layer."""
    m = cfg.model
    if m.recompute_layers != "auto":
        return {"recompute": m.recompute, "recompute_layers": m.recompute_layers}
    stage_layers = layers_per_stage(cfg, arch)[stage]
    n = stage_layers if plan is None else plan.recompute_layers[stage]
    if n <= 0:
        return {"recompute": False, "recompute_layers": None}
    if n >= stage_layers:
        return {"recompute": True, "recompute_layers": None}
    v = getattr(cfg.parallelism, "virtual_stages", 1) or 1  # Megatron's count is per model chunk: round up
    return {"recompute": True, "recompute_layers": -(-n // v)}


def oom_error(cfg, plan: MemoryPlan | None, stage: int, chunk: int, arch=None) -> MemoryFitError:
    """The one-line error for a ``torch.OutOfMemoryError`` while training ``chunk`` on pipeline ``stage``."""
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")
    total = torch.cuda.mem_get_info()[1] / GIB if torch.cuda.is_available() else float("nan")
    msg = (f"{cfg.source}: pipeline stage {stage} ran out of GPU memory in chunk {chunk}: {peak:.1f} GiB allocated "
           f"at the peak of {total:.1f} GiB")
    if plan is not None:
        s = plan.stages[stage]
        msg += (f" (the memory model predicted a peak of {s.peak / GIB:.1f} GiB at token_capacity {plan.capacity} "
                f"with {s.recompute_layers} of {s.layers} layers recomputed)")
    fixes = []
    if plan is not None:
        dp = cfg.parallelism.dp if isinstance(cfg.parallelism.dp, int) else 1
        setup = setup_from_run(cfg, arch or run_arch(cfg), dp=dp)
        longest = max((j.dataset.max_seq_len for j in cfg.jobs), default=1)
        fixes = oom_advice(setup, plan, stage, peak * GIB, longest, load_coefficients())
    msg += (". The memory model, corrected by this stage's miss, fits: " + "; or ".join(fixes) if fixes else
            ". Nothing in reach of the memory model fits: more pipeline stages, tensor parallelism or shorter "
            "samples (dataset.max_seq_len with truncate: true)")
    msg += "; checkpoints already written are intact"
    return MemoryFitError(msg)
