"""``summary.json``: what a run did, written once at its end (the CLI prints it, benchmarks read it)."""

from __future__ import annotations

import json

import torch

from lorafusion import ops
from lorafusion.core.impls import kernels_name, lora_impl
from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.layout import RunDir


def write_summary(trainer) -> dict:
    """The run's summary (tokens, speed, plan, each job's end state); written by the logging rank."""
    t, tele, plan = trainer, trainer.telemetry, trainer.plan
    impl = ops.resolve_impl(torch.empty(0, device=t.device or "cpu"), lora_impl(plan.kernels))
    summary = {
        "status": "stopped" if t.stopped else "done", "stopped_by": t.stopped,
        "tokens": sum(js.tokens for js in t.jobs.values()),  # the whole run, resumed parts included
        "session_tokens": tele.tokens,
        "elapsed_s": round(t.elapsed, 3), "tokens_per_s": tele.tokens / max(t.elapsed, 1e-9),
        "windows": tele.chunks, "plan_s": round(tele.plan_s, 3), "plan_wait_s": round(t.feed.wait_s, 3),
        "noop_microbatches": tele.noops, "bubble_ratio": tele.bubble_ratio,
        "parallelism": plan.parallelism, "memory_plan": plan.memory and plan.memory.to_dict(),
        "run_plan": plan.to_dict(), "kernels": kernels_name(impl),
        "jobs": {n: {"status": js.final_status,
                     "steps": js.steps, "total_steps": js.stream.total_steps, "tokens": js.tokens,
                     "final_loss": js.last_loss, "first_loss": js.first_loss, **t.evaluator.summary(js)}
                 for n, js in t.jobs.items()},
    }
    if t.is_logger:
        write_text_atomic(RunDir(t.out).summary, json.dumps(summary, indent=2) + "\n")
        tele.end(summary)
    return summary
