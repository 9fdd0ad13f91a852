"""The one virtual-stage check (core.pipeline), as the run config and the scheduler both report it."""

import pytest

from lorafusion.core.pipeline import virtual_stages_problem


def test_interleaving_needs_a_pipeline():
    assert virtual_stages_problem(1, 1) is None and virtual_stages_problem(4, 2) is None
    assert virtual_stages_problem(1, 2) == "2 needs a pipeline (pp > 1)"
    assert "at least 1" in virtual_stages_problem(4, 0)


def test_config_and_scheduler_say_the_same():
    from lorafusion.config.schema import ParallelismConfig
    from lorafusion.scheduler import PlanError, SchedulerConfig

    with pytest.raises(ValueError, match=r"virtual_stages: 2 needs a pipeline \(pp > 1\)"):
        ParallelismConfig(pp=1, virtual_stages=2)
    with pytest.raises(PlanError, match=r"virtual_stages: 2 needs a pipeline \(pp > 1\)"):
        SchedulerConfig(pipeline_depth=1, virtual_stages=2)
