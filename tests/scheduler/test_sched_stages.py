"""stages.py: loss-aware splits, per-virtual-stage costs, the FLOP cost model, ``stage_layers`` resolution."""

from __future__ import annotations

import pytest

from lorafusion.core.arch import preset
from lorafusion.scheduler import PlanError, stages
from lorafusion.scheduler.stagecost import load_stage_costs


def test_flop_ratio_of_the_70b_output_layer():
    arch = preset("llama3.1-70b")
    assert stages.decoder_layer_params(arch) == 855_638_016
    assert stages.flop_loss_layers(arch) == pytest.approx(128256 * 8192 / 855_638_016)
    # the factor fitted for this model's shape (stage_costs.json), not the default for unmeasured models
    factor = load_stage_costs().loss_flop_factor_by_preset["llama3.1-70b"]
    assert stages.loss_layers(arch) == pytest.approx(factor * stages.flop_loss_layers(arch))


@pytest.mark.parametrize("S,V,loss", [(4, 1, 2.46), (4, 2, 2.46), (4, 5, 2.46), (2, 2, 0.0), (3, 2, 5.0)])
def test_auto_split_minimises_the_busiest_rank(S, V, loss):
    """No split moves the busiest rank below auto's (checked against every single-layer move) and the loss
    makes the last virtual stage lighter."""
    L = 80 if S == 4 else 24
    split = stages.auto_split(L, S, V, loss)
    assert len(split) == S * V and sum(split) == L and min(split) >= 1
    best = max(stages.rank_loads(split, S, loss))
    assert best <= (L + loss) / S + 1.0  # within one layer of the fractional optimum
    for a in range(S * V):
        for b in range(S * V):
            if a != b and split[a] > 1:
                moved = list(split)
                moved[a] -= 1
                moved[b] += 1
                assert max(stages.rank_loads(moved, S, loss)) >= best - 1e-9
    if loss >= 1:
        assert split[-1] < max(split)


def test_stage_costs_and_resolution():
    costs = stages.stage_costs([3, 3, 2], loss=1.0, backward_ratio=2.0)
    assert sum(f for f, _ in costs) == pytest.approx(1.0) and costs[-1] == pytest.approx((1 / 3, 2 / 3))
    assert stages.resolve_split(None, 8, 2, 2) == [2, 2, 2, 2]
    assert stages.resolve_split([1, 3, 3, 1], 8, 2, 2) == [1, 3, 3, 1]
    assert sum(stages.resolve_split("auto", 8, 2, 2, loss=1.0)) == 8
    with pytest.raises(PlanError, match=r"one count >= 1 per virtual stage \(pp x virtual_stages = 4"):
        stages.resolve_split([4, 4], 8, 2, 2)
    with pytest.raises(PlanError, match="do not split evenly over pp=4 x virtual_stages=2"):
        stages.resolve_split(None, 10, 4, 2)
    with pytest.raises(PlanError, match="cannot fill"):
        stages.auto_split(3, 2, 2)


def test_flop_cost_model_counts_attention_per_sample():
    arch = preset("llama3.1-70b")
    cm = stages.flop_cost_model(arch, loss=0.0, flops_per_s=1.0)
    linear = 2.0 * stages.decoder_layer_params(arch) * 80
    assert cm.microbatch_time([4096]) == pytest.approx(linear * 4096 + 2.0 * 8192 * 80 * 4096 ** 2)
    assert cm.microbatch_time([2048, 2048]) < cm.microbatch_time([4096])
