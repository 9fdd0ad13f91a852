"""What a pipeline layout allows, torch-free: the one check of a virtual-stage count (the run config's
``parallelism`` section and the scheduler's ``SchedulerConfig`` both ask it) and the counts
``virtual_stages: auto`` chooses from (``lorafusion.resolve``)."""

from __future__ import annotations

__all__ = ["MAX_AUTO_VIRTUAL_STAGES", "virtual_stage_choices", "virtual_stages_problem"]


def virtual_stages_problem(pp: int, virtual_stages: int) -> str | None:
    """Why ``virtual_stages`` model chunks per rank cannot run on a pipeline of ``pp`` ranks (interleaved 1F1B
    needs one), in words that follow the field's name; None when they can."""
    if virtual_stages < 1:
        return f"expected at least 1 model chunk per pipeline rank, got {virtual_stages}"
    if virtual_stages > 1 and pp < 2:
        return f"{virtual_stages} needs a pipeline (pp > 1)"
    return None


# the largest V that ``virtual_stages: auto`` tries: each model chunk adds a p2p hand-over and a schedule step
# per microbatch on every rank, work the simulator counts only as transfer time
MAX_AUTO_VIRTUAL_STAGES = 8


def virtual_stage_choices(pp: int, num_layers: int, stage_layers=None,
                          limit: int = MAX_AUTO_VIRTUAL_STAGES) -> list[int]:
    """The virtual-stage counts ``virtual_stages: auto`` may choose from on a pipeline of ``pp`` ranks for a
    model of ``num_layers`` decoder layers with ``stage_layers`` (None: the even split, which needs pp·V to
    divide the layers; "auto": any split of at least one layer per virtual stage; a list: the V its length
    gives), at most ``limit``; [1] without a pipeline."""
    if pp < 2:
        return [1]
    if isinstance(stage_layers, (list, tuple)):
        v = len(stage_layers) // pp
        return [v] if len(stage_layers) == v * pp and virtual_stages_problem(pp, v) is None else []
    out = []
    for v in range(1, limit + 1):
        if virtual_stages_problem(pp, v) is None and pp * v <= num_layers and (
                stage_layers == "auto" or num_layers % (pp * v) == 0):
            out.append(v)
    return out
