"""What a pipeline layout allows, torch-free: the one check of a virtual-stage count (the run config's
``parallelism`` section and the scheduler's ``SchedulerConfig`` both ask it)."""

from __future__ import annotations

__all__ = ["virtual_stages_problem"]


def virtual_stages_problem(pp: int, virtual_stages: int) -> str | None:
    """Why ``virtual_stages`` model chunks per rank cannot run on a pipeline of ``pp`` ranks (interleaved 1F1B
    needs one), in words that follow the field's name; None when they can."""
    if virtual_stages < 1:
        return f"expected at least 1 model chunk per pipeline rank, got {virtual_stages}"
    if virtual_stages > 1 and pp < 2:
        return f"{virtual_stages} needs a pipeline (pp > 1)"
    return None
