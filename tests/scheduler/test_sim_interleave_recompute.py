"""stages.recompute_stage_costs (what scripts/sim_interleave.py --gpu-memory and virtual_stages: auto
simulate): each virtual stage's recomputed layers cost RECOMPUTE_COST of a layer's forward + backward in its
backward (a rank's count per model chunk, at most the stage's layers); the forwards and the stages without
recompute are stage_costs' own."""

import pytest

from lorafusion.scheduler import stages
from lorafusion.scheduler.sizing import RECOMPUTE_COST
from lorafusion.scheduler.stages import recompute_stage_costs

BACKWARD_RATIO = 2.0


def test_recomputed_layers_add_to_their_virtual_stages_backward():
    split, loss, pp = [3, 2, 1, 2], 1.5, 2  # PP=2 x V=2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    per_chunk = [2, 0]  # rank 0 recomputes 2 layers of each chunk (its 1-layer chunk: 1), rank 1 none
    got = recompute_stage_costs(split, loss, pp, per_chunk, BACKWARD_RATIO)
    base = stages.stage_costs(split, loss, BACKWARD_RATIO)
    total = sum(split) + loss
    for i, ((f, b), (f0, b0)) in enumerate(zip(got, base, strict=True)):
        assert f == pytest.approx(f0)
        recomputed = min(per_chunk[i % pp], split[i])
        assert b - b0 == pytest.approx((1 + BACKWARD_RATIO) * RECOMPUTE_COST * recomputed / total)
    assert [b > b0 for (_, b), (_, b0) in zip(got, base, strict=True)] == [True, False, True, False]
