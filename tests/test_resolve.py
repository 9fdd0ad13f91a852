"""lorafusion.resolve: every ``auto`` of a run config made a value in one frozen RunPlan, without writing the
config; the memory search keeps what it rejected and why. torch-free."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lorafusion.config import load_run_config
from lorafusion.core.errors import ConfigError
from lorafusion.resolve import GpuMemory, World, resolve
from lorafusion.scheduler.memory import GIB, load_coefficients

ROOT = Path(__file__).resolve().parents[1]
C70 = ROOT / "configs/llama3.1-70b-4adapters.yaml"
C8 = ROOT / "configs/llama3.1-8b-4adapters.yaml"


def _gpu(gib: float) -> GpuMemory:
    return GpuMemory(gib * GIB, gib * GIB)


def test_resolve_makes_every_auto_a_value_and_writes_nothing():
    cfg = load_run_config(C70, ["parallelism.stage_layers=auto"], check_files=False)
    before = cfg.model_dump()
    plan = resolve(cfg, World(8), _gpu(80))
    assert cfg.model_dump() == before  # the loaded config is read, never written
    assert (plan.dp, plan.world, plan.scheduler.dp_size, plan.scheduler.pipeline_depth) == (2, 8, 2, 4)
    assert isinstance(plan.token_capacity, int) and plan.scheduler.token_capacity == plan.token_capacity
    assert sum(plan.stage_layers) == 80 and len(plan.recompute_layers) == 4 and plan.kernels == "fused"
    assert set(plan.auto) == {"dp", "stage_layers", "kernels", "token_capacity", "recompute_layers",
                              "attention", "tp_overlap"}
    assert plan.parallelism["dp"] == 2 and plan.parallelism["stage_layers"] == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.token_capacity = 1  # type: ignore[misc]


def test_without_a_gpu_the_cost_model_capacity_and_every_layer_recomputed():
    cfg = load_run_config(C70, check_files=False)
    plan = resolve(cfg, World(4), None)
    assert plan.memory is None and plan.fits and plan.kernels == "reference"
    # the default cost model's capacity: at least the longest sample (4096)
    assert plan.token_capacity == 5120
    # every layer of the loss-aware split (the fitted stage costs: the loss 2.47 layers on the last rank,
    # the first rank 0.5 of a layer below its layers' work)
    assert plan.recompute_layers == plan.stage_layers == (21, 20, 21, 18)
    assert [plan.recompute_kwargs(k) for k in range(4)] == [{"recompute": True, "recompute_layers": None}] * 4
    long = load_run_config(C70, [f"jobs.{i}.dataset.max_seq_len=9000" for i in range(4)], check_files=False)
    assert resolve(long, World(4), None).token_capacity == 9216  # never below the longest sample


def test_the_launch_must_match_the_layout():
    cfg = load_run_config(C70, ["parallelism.dp=1"], check_files=False)
    with pytest.raises(ConfigError, match=r"tp\*pp\*dp = 1\*4\*1 = 4, but the launch has 8 process"):
        resolve(cfg, World(8), None)
    auto = load_run_config(C70, check_files=False)
    with pytest.raises(ConfigError, match="dp: auto needs tp.pp = 1.4 = 4 to divide the launch's 6"):
        resolve(auto, World(6), None)


def test_plan_and_train_print_the_same_lines_for_the_same_memory():
    """`lorafusion plan --gpu-memory X` and a run on a GPU with X free resolve through the same function: the
    same values, printed by the same RunPlan.lines (a GPU's total only changes the head line's wording)."""
    cfg = load_run_config(C8, check_files=False)
    a, b = resolve(cfg, World(1), GpuMemory(80 * GIB, 80 * GIB)), resolve(cfg, World(1),
                                                                          GpuMemory(80 * GIB, 81 * GIB))
    assert a.token_capacity == b.token_capacity == 16896 and a.lines()[1:] == b.lines()[1:]


def test_the_search_keeps_the_plans_it_beat():
    cfg = load_run_config(C70, check_files=False)
    plan = resolve(cfg, World(4), _gpu(80), coeffs=load_coefficients())
    mem = plan.memory
    assert mem.fits and mem.alternatives and all(a["cost"] >= mem.cost for a in mem.alternatives)
    assert any(a["what"] == "the run's split" for a in mem.alternatives)
    assert plan.stage_layers == tuple(mem.stage_layers) and sum(plan.stage_layers) == 80  # the split it chose
    lines = plan.lines()
    assert [x for x in lines if x.startswith("    token_capacity ")] == ["    " + x for x in mem.why()]
    assert "  without recompute: nothing fits" in "\n".join(lines)  # why it recomputes


def test_a_split_that_does_not_exist_is_one_config_error():
    cfg = load_run_config(C70, ["parallelism.virtual_stages=3", "parallelism.stage_layers=null"],
                          check_files=False)
    with pytest.raises(ConfigError, match="llama3.1-70b-4adapters.yaml: .*do not split evenly"):
        resolve(cfg, World(4), None)


def test_a_job_on_a_subset_of_a_fused_linear_is_planned():
    """A job targeting q_proj and v_proj (PEFT names, a subset of the fused qkv) is sized like any other: the
    memory plan counted adapters by Megatron linear and failed on its names (KeyError: 'q_proj'), on a GPU
    and, for the host's memory, on a CPU."""
    cfg = load_run_config(C8, ["jobs.0.lora.target_modules=[q_proj,v_proj]"], check_files=False)
    full = resolve(load_run_config(C8, check_files=False), World(1), _gpu(80))
    plan = resolve(cfg, World(1), _gpu(80))
    assert plan.fits and plan.memory.stages[0].lora < full.memory.stages[0].lora
    assert resolve(cfg, World(1), None).host.parts["adapters+optimizer"] > 0


def test_tp_overlap_auto_is_off_and_on_is_refused_where_it_cannot():
    """``parallelism.tp_overlap``: auto is off (the overlap has not been measured to pay: the printout says
    so); on overlaps the TP collectives at tp > 1, with or without a GPU; off is off; on with an FP8 base is
    one clear error."""
    def plan(*over, gpu=True, sp=True):
        cfg = load_run_config(C8, ["parallelism.tp=2", f"parallelism.sequence_parallel={str(sp).lower()}",
                                   *over], check_files=False)
        return resolve(cfg, World(2), _gpu(80) if gpu else None)

    auto = plan()
    assert auto.tp_overlap == 0 and "tp_overlap" in auto.auto and auto.to_dict()["tp_overlap"] == 0
    assert auto.model_kwargs(0)["tp_overlap"] == 0 and auto.model_kwargs(0)["sequence_parallel"]
    assert "tp_overlap off (not measured to help yet) (auto)" in "\n".join(auto.lines())
    assert plan(sp=False).tp_overlap == 0 and plan(gpu=False).tp_overlap == 0
    assert plan("model.base_precision=fp8").tp_overlap == 0
    on = plan("parallelism.tp_overlap=on")
    assert on.tp_overlap == 2 and "tp_overlap" not in on.auto and on.model_kwargs(0)["tp_overlap"] == 2
    assert "tp_overlap on, per sequence shard" in "\n".join(on.lines())
    no_sp = plan("parallelism.tp_overlap=on", sp=False)
    assert "tp_overlap on, 2 nano-batches" in "\n".join(no_sp.lines())
    assert plan("parallelism.tp_overlap=on", "parallelism.tp_overlap_chunks=4").tp_overlap == 4
    assert plan("parallelism.tp_overlap=off").tp_overlap == 0
    assert plan("parallelism.tp_overlap=on", gpu=False).tp_overlap == 2  # (CPU tests run it on gloo)
    one = resolve(load_run_config(C8, check_files=False), World(1), _gpu(80))
    assert one.tp_overlap == 0 and "tp_overlap off (tp = 1) (auto)" in "\n".join(one.lines())
    with pytest.raises(ConfigError, match=r"llama3.1-8b-4adapters.yaml: parallelism.tp_overlap: on does not "
                                          r"apply with model.base_precision: fp8"):
        plan("parallelism.tp_overlap=on", "model.base_precision=fp8")
