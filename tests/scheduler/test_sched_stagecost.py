"""The stage cost model (scheduler/stagecost.py, stage_costs.json) fitted by scripts/fit_stage_costs.py to the
per-rank busy time of the pipeline runs under docs/results/, and the 70B plans the split / recompute chooser
makes with it. torch-free."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lorafusion.config import load_run_config
from lorafusion.core.arch import preset
from lorafusion.resolve import GpuMemory, World, memory_setup, resolve
from lorafusion.scheduler.memory import GIB, load_coefficients
from lorafusion.scheduler.sizing import rank_loads
from lorafusion.scheduler.stagecost import STAGE_COSTS_FILE, StageCosts, load_stage_costs, rank_work

ROOT = Path(__file__).resolve().parents[2]
C70 = ROOT / "configs/llama3.1-70b-4adapters.yaml"
H100 = json.loads((ROOT / "docs/results/70b-4xh100.json").read_text())


def _fit_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fit_stage_costs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return fit_stage_costs


def test_the_fit_script_reproduces_the_committed_coefficients():
    fsc = _fit_module()
    runs = [r for r in fsc.load_runs() if r.model not in fsc.EXCLUDED]
    committed = json.loads(STAGE_COSTS_FILE.read_text())
    assert [r.name for r in runs] == committed["records"]
    models = sorted({r.model for r in runs}, key=lambda m: -sum(r.model == m for r in runs))
    theta, _ = fsc.fit(runs, models)
    got = fsc.costs_of(theta, models)
    want = load_stage_costs()
    for name in ("recompute", "first_rank", "fp8_layer", "loss_flop_factor"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), abs=2e-3), name
    assert got.loss_flop_factor_by_preset == pytest.approx(want.loss_flop_factor_by_preset, abs=2e-3)


def test_the_records_are_read_as_they_ran():
    """Split, recompute and precision per run from the record (memory plan, overrides) or its config at its
    commit: the 32B PP=2 run recomputed every layer (its config then), the FP8 run kept layer 1 in bf16."""
    runs = {r.name: r for r in _fit_module().load_runs()}
    bf, fp = runs["70b-4xh100.json.bf16"], runs["70b-4xh100.json.fp8"]
    assert (bf.split, bf.recompute, bf.precision) == ((18, 19, 21, 22), (12, 10, 8, 0), "bf16")
    assert (fp.split, fp.recompute, fp.precision) == ((18, 20, 22, 20), (9, 7, 2, 0), "fp8")
    assert bf.group == fp.group  # one machine kind, commit, capacity and layout: one time scale
    assert runs["32b-pp2-2gpu.json"].recompute == (32, 32)
    assert runs["70b-pp4-4gpu.json"].recompute == (0, 0, 0, 0)
    tp2 = runs["70b-tp2pp2-4gpu.json"]
    assert tp2.pp == 2 and tp2.busy[0] == pytest.approx(89.9005 * (1 - 0.0939425), rel=1e-4)


def test_rank_work_counts_fp8_layers_recompute_loss_and_first_rank():
    c = StageCosts(recompute=0.4, loss_flop_factor=2.0, first_rank=-0.5, fp8_layer=0.8)
    f = 0.8
    got = rank_work([18, 20, 22, 20], 4, [9, 7, 2, 0], 2.5, c, bf16_leading=1)
    want = [1 + 17 * f + 0.4 * (1 + 8 * f) - 0.5, 20 * f + 0.4 * 7 * f, 22 * f + 0.4 * 2 * f, 20 * f + 2.5]
    assert got == pytest.approx(want)
    assert rank_work([18, 20, 22, 20], 4, [9, 7, 2, 0], 2.5, c) == pytest.approx(
        [18 + 3.6 - 0.5, 20 + 2.8, 22 + 0.8, 22.5])
    # V=2: rank r holds virtual stages r and r + pp; the loss on the last one's rank, the offset on rank 0
    assert rank_work([5, 5, 5, 5], 2, [0, 0], 2.5, c) == pytest.approx([9.5, 12.5])


def _measured_shares(rec: dict) -> list[float]:
    busy = [1 - b for b in rec["bubble_ratio_per_rank"]]
    return [x * len(busy) / sum(busy) for x in busy]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_planner_predicts_the_measured_h100_ranks_better_than_before(precision):
    """The plan that ran on 4x H100 (its split and recompute): the planner's per-rank work shares
    (sizing.rank_loads) against the measured busy shares, closer than the constants before the fit."""
    rec = H100[precision]
    cfg = load_run_config(C70, ["parallelism.dp=1", f"model.base_precision={precision}"], check_files=False)
    split = tuple(rec["parallelism"]["stage_layers"])
    s = replace(memory_setup(cfg, preset("llama3.1-70b")), stage_layers=split)
    rc = rec["memory_plan"]["recompute_layers"]
    lead = 1 if precision == "fp8" else None
    old = rank_work(s.stage_layers, 4, rc, 2.0 * 1.2283, StageCosts(), lead)
    new = rank_loads(s, rc)
    meas = _measured_shares(rec)

    def err(w):
        return max(abs(x * len(w) / sum(w) - m) for x, m in zip(w, meas, strict=True))

    assert err(new) < err(old) and err(new) < 0.03


@pytest.mark.parametrize("precision,gpu,split,rc,cap", [
    ("bf16", 80, [19, 20, 21, 20], [9, 6, 1, 0], 4096),
    ("fp8", 80, [19, 20, 22, 19], [8, 4, 0, 0], 5120),
    ("bf16", 76, [19, 20, 21, 20], [11, 8, 3, 0], 4096),
    ("fp8", 76, [19, 20, 22, 19], [8, 3, 0, 0], 4608),
])
def test_the_70b_split_on_80gb_is_stable_and_balanced(precision, gpu, split, rc, cap):
    """What auto picks for the shipped 70B on 80 GB GPUs (80 GiB and the 76 GiB a 4x H100 run reads as free):
    the busiest rank within 2.5% of the mean under the fitted stage costs, and no one-layer move between
    neighbouring stages (at the fewest recompute that fits) lowers the busiest rank's work."""
    from lorafusion.scheduler.sizing import _fewest

    cfg = load_run_config(C70, ["parallelism.dp=1", f"model.base_precision={precision}"], check_files=False)
    run = resolve(cfg, World(4), GpuMemory(gpu * GIB, gpu * GIB))  # what `lorafusion plan` prints
    plan, s, c = run.memory, run.setup, load_coefficients()
    assert (plan.stage_layers, plan.recompute_layers, plan.capacity) == (split, rc, cap)
    best = rank_loads(replace(s, stage_layers=tuple(split)), rc)
    assert max(best) * 4 / sum(best) < 1.025
    for k in range(3):
        for d in (-1, 1):
            other = list(split)
            other[k], other[k + 1] = other[k] + d, other[k + 1] - d
            so = replace(s, stage_layers=tuple(other))
            rco = [_fewest(so, i, cap, gpu * GIB, c) for i in range(4)]
            if None not in rco:
                assert max(rank_loads(so, rco)) >= max(best) - 1e-9, other


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_simulator_agrees_with_the_chosen_70b_split(precision):
    """Scoring the split candidates with the pipeline simulator (unequal microbatches: a synthetic chunk of
    the config's jobs, each microbatch's attention per sample²) picks the split the chooser picked by the
    busiest rank's work, among every one-layer move between neighbouring stages: the chooser needs no
    simulator (scripts/sim_check_runs.py --split-check does the same on the benchmark data)."""
    from lorafusion.scheduler import simulate_plan, stages
    from lorafusion.scheduler.planner import plan
    from lorafusion.scheduler.sizing import _fewest
    from lorafusion.scheduler.virtual import synthetic_jobs

    cfg = load_run_config(C70, ["parallelism.dp=1", f"model.base_precision={precision}"], check_files=False)
    run = resolve(cfg, World(4), GpuMemory(80 * GIB, 80 * GIB))
    m, s, arch = run.memory, run.setup, preset("llama3.1-70b")
    jobs = synthetic_jobs([(j.name, j.global_batch_size, j.dataset.max_seq_len) for j in cfg.jobs], 8)
    chunk = plan(jobs, replace(run.scheduler, solver="greedy", milp_time_limit_s=0.0))
    loss, lead = stages.loss_layers(arch), (1 if precision == "fp8" else None)
    cm = stages.flop_cost_model(arch, loss)

    def span(split, rc):
        costs = stages.recompute_stage_costs(split, loss, 4, rc, 2.0, lead, stages.embedding_layers())
        return simulate_plan(chunk, cm, backward_ratio=2.0, stage_costs=costs)[0].makespan

    best = span(list(m.stage_layers), list(m.recompute_layers))
    for k in range(3):
        for d in (-1, 1):
            other = list(m.stage_layers)
            other[k], other[k + 1] = other[k] + d, other[k + 1] - d
            so = replace(s, stage_layers=tuple(other))
            rc = [_fewest(so, i, m.capacity, m.gpu_bytes, load_coefficients()) for i in range(4)]
            if None not in rc:
                assert span(other, rc) > best, other


def test_only_a_narrower_base_counts_as_fp8():
    from lorafusion.scheduler.stagecost import bf16_leading

    cfg = load_run_config(C70, ["parallelism.dp=1"], check_files=False)
    s = memory_setup(cfg, preset("llama3.1-70b"))
    assert bf16_leading(s) is None
    assert bf16_leading(replace(s, base_bytes_per_param=2.0, bf16_base_layers=1)) is None  # bf16 bytes: bf16
    assert bf16_leading(replace(s, base_bytes_per_param=1.0, bf16_base_layers=1)) == 1
