"""``parallelism.virtual_stages: auto`` (lorafusion.resolve with lorafusion.scheduler.virtual): the run
resolved at every virtual-stage count the layers allow, each scored by the pipeline simulator on a chunk
planned at its capacity with its recompute; the fastest that fits is chosen and printed with the
alternatives it beat and their predicted cost. torch-free."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafusion.config import load_run_config
from lorafusion.core.errors import ConfigError
from lorafusion.core.pipeline import virtual_stage_choices
from lorafusion.resolve import GpuMemory, World, resolve, run_arch
from lorafusion.scheduler import virtual
from lorafusion.scheduler.memory import GIB

ROOT = Path(__file__).resolve().parents[1]
C70 = ROOT / "configs/llama3.1-70b-4adapters.yaml"
QUICK = ROOT / "configs/quickstart.yaml"


def _gpu(gib: float) -> GpuMemory:
    return GpuMemory(gib * GIB, gib * GIB)


def _cfg(path, *overrides):
    return load_run_config(path, ["parallelism.virtual_stages=auto", *overrides], check_files=False)


def test_the_counts_the_layers_allow():
    assert virtual_stage_choices(1, 80) == [1]
    assert virtual_stage_choices(4, 80) == [1, 2, 4, 5]  # the even split: pp·V divides the layers
    assert virtual_stage_choices(4, 80, "auto") == list(range(1, 9))  # any split, up to the limit
    assert virtual_stage_choices(4, 12, "auto") == [1, 2, 3]  # one layer per virtual stage at least
    assert virtual_stage_choices(2, 4, [1, 1, 1, 1]) == [2]  # a list gives its V
    assert virtual_stage_choices(3, 4) == []  # no even split at any V


def test_without_a_pipeline_auto_is_one_and_says_why():
    plan = resolve(_cfg(QUICK), World(1), None)
    assert plan.virtual_stages == 1 and "virtual_stages" in plan.auto
    assert plan.virtual.reason == "no pipeline (pp = 1)" and plan.virtual.candidates == ()
    assert "  virtual_stages 1 (auto): no pipeline (pp = 1)" in plan.lines()
    assert plan.to_dict()["virtual_stages"]["chosen"] == 1 and plan.parallelism["virtual_stages"] == 1


def test_a_stage_layers_list_gives_its_count():
    plan = resolve(_cfg(QUICK, "parallelism.pp=2", "parallelism.stage_layers=[1,1,1,1]"), World(2), None)
    assert plan.virtual_stages == 2 and plan.stage_layers == (1, 1, 1, 1)
    assert "the only count the layers allow (2)" in plan.virtual.reason
    assert plan.scheduler.virtual_stages == 2


def test_the_fastest_that_fits_is_chosen_and_the_alternatives_printed():
    """70B, PP=4 on 139 GiB: every V from 1 to 8 resolved and simulated; the choice has the least predicted
    time, each alternative is printed with its capacity, recompute and time relative to the choice."""
    plan = resolve(_cfg(C70, "parallelism.dp=1"), World(4), _gpu(139))
    cands = plan.virtual.candidates
    assert [c.virtual_stages for c in cands] == list(range(1, 9)) and all(c.fits for c in cands)
    best = min(cands, key=lambda c: c.score.time_per_token)
    assert plan.virtual_stages == best.virtual_stages == plan.virtual.chosen
    assert plan.scheduler.virtual_stages == plan.virtual_stages
    assert len(plan.stage_layers) == 4 * best.virtual_stages
    lines = plan.lines()
    chosen = f"  virtual_stages {plan.virtual_stages} (auto): the fastest"
    head = next(x for x in lines if x.startswith(chosen))
    assert f"{best.score.noops} no-op(s) in {best.score.microbatches} microbatches" in head
    for c in cands:
        if c is not best:
            ratio = c.score.time_per_token / best.score.time_per_token
            assert ratio >= 1.0
            assert (f"    virtual_stages {c.virtual_stages} (token_capacity {c.token_capacity}, "
                    f"recompute_layers {list(c.recompute_layers)}): {ratio:.3f}x the time per token"
                    ) in "\n".join(lines)
    rows = plan.to_dict()["virtual_stages"]["candidates"]
    assert [r["virtual_stages"] for r in rows] == list(range(1, 9)) and all(r["predicted_time_per_token"]
                                                                           for r in rows)


def test_the_bubble_wins_where_each_op_costs_nothing_and_loses_to_per_op_work(monkeypatch):
    """Without per-op work the simulator's smaller bubble makes a V > 1 the fastest on the 70B at 139 GiB;
    with the measured per-op work (OP_S) every extra model chunk costs, and V = 1 wins."""
    cfg = _cfg(C70, "parallelism.dp=1")
    monkeypatch.setattr(virtual, "OP_S", 0.0)
    free = resolve(cfg, World(4), _gpu(139))
    assert free.virtual_stages > 1
    one = next(c for c in free.virtual.candidates if c.virtual_stages == 1)
    assert one.score.bubble > next(c for c in free.virtual.candidates
                                   if c.virtual_stages == free.virtual_stages).score.bubble
    monkeypatch.setattr(virtual, "OP_S", 0.05)
    assert resolve(cfg, World(4), _gpu(139)).virtual_stages == 1


def test_a_count_that_does_not_fit_loses_and_is_printed_so():
    """With capacity and recompute fixed, V = 2 holds more microbatches in flight than V = 1: on a GPU
    between the two needs, V = 2 does not fit, V = 1 is chosen, and V = 2 is printed as not fitting."""
    fixed = ("parallelism.pp=2", "parallelism.stage_layers=auto", "model.recompute=false",
             "model.recompute_layers=null", "scheduler.token_capacity=4096")
    need = {}
    for v in (1, 2):
        cfg = load_run_config(C70, ["parallelism.dp=1", f"parallelism.virtual_stages={v}", *fixed],
                              check_files=False)
        need[v] = max(s.need for s in resolve(cfg, World(2), _gpu(1000)).memory.stages)
    assert need[2] > need[1]
    gpu = GpuMemory((need[1] + need[2]) / 2, 1000 * GIB)
    plan = resolve(_cfg(C70, "parallelism.dp=1", *fixed), World(2), gpu)
    assert plan.virtual_stages == 1 and plan.fits
    two = next(c for c in plan.virtual.candidates if c.virtual_stages == 2)
    assert not two.fits and two.score is None
    assert "    virtual_stages 2 (token_capacity 4096, recompute_layers [0, 0]): does not fit" in plan.lines()


def test_a_count_that_forces_recompute_pays_for_it(monkeypatch):
    """The recompute the memory plan forces at a V is in its simulated time: the same chunk with each model
    chunk's layers recomputed takes longer, by the recompute's share."""
    cfg = _cfg(C70, "parallelism.dp=1")
    plan = resolve(cfg, World(4), _gpu(139))
    arch = run_arch(cfg)
    jobs = virtual.synthetic_jobs([(j.name, j.global_batch_size, j.dataset.max_seq_len) for j in cfg.jobs],
                                  cfg.scheduler.lookahead_batches)
    split = list(plan.stage_layers)
    bare = virtual.score_virtual(jobs, plan.scheduler, arch, split, [0] * 4)
    recomputed = virtual.score_virtual(jobs, plan.scheduler, arch, split, [max(split)] * 4)
    assert recomputed.time_per_token > 1.3 * bare.time_per_token
    assert (recomputed.tokens, recomputed.microbatches) == (bare.tokens, bare.microbatches)


def test_the_synthetic_chunk_spreads_every_global_batch_over_the_lengths():
    jobs = virtual.synthetic_jobs([("a", 4, 1000), ("b", 2, 64)], lookahead=3)
    a, b = jobs
    assert [len(g) for g in a.global_batches] == [4, 4, 4] and a.global_batch_size == 4
    lengths = sorted(n for g in a.global_batches for _, n in g)
    assert lengths == [round(1000 * (2 * i + 1) / 24) for i in range(12)]
    assert all(max(n for _, n in g) > 750 and min(n for _, n in g) < 250 for g in a.global_batches)
    assert max(n for g in b.global_batches for _, n in g) <= 64


def test_layers_that_allow_no_count_are_one_config_error():
    with pytest.raises(ConfigError, match=r"quickstart.yaml: parallelism.virtual_stages: auto: no "
                                          r"virtual-stage count up to 8 splits 4 decoder layers evenly over "
                                          r"pp=3"):
        resolve(_cfg(QUICK, "parallelism.pp=3"), World(3), None)


@pytest.mark.parametrize("value, message", [
    ("many", "parallelism.virtual_stages: expected an integer >= 1 or 'auto', got 'many'"),
    (0, "parallelism.virtual_stages: expected an integer >= 1 or 'auto', got 0"),
])
def test_a_bad_value_is_one_config_error(value, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(QUICK, [f"parallelism.virtual_stages={value}"], check_files=False)


def test_a_stage_layers_list_that_gives_no_count_is_one_config_error():
    with pytest.raises(ConfigError, match=r"parallelism.stage_layers: expected one count per virtual "
                                          r"stage \(pp x V for virtual_stages: auto, in layer order\) "
                                          r"\(pp = 2\)"):
        _cfg(QUICK, "parallelism.pp=2", "parallelism.stage_layers=[1,2,1]")
