"""The memory model (scheduler/memory.py) and the sizing on it (scheduler/sizing.py): exact parameter counts,
each part's dependence on the settings, the committed coefficients against peaks measured on GPUs, the auto
choice, the plan report and its errors. torch-free."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lorafusion.core.arch import preset
from lorafusion.scheduler.memory import (
    GIB,
    AdapterShape,
    MemorySetup,
    attention_elems,
    base_bytes_per_layer,
    in_flight,
    load_coefficients,
    lora_params_per_layer,
    plan_memory,
    stage_memory,
)
from lorafusion.resolve import GpuMemory, World, memory_setup, resolve, run_arch
from lorafusion.scheduler.sizing import choose, no_fit_message, parse_bytes

ROOT = Path(__file__).resolve().parents[2]
R16 = tuple(AdapterShape(16, dropout=0.1) for _ in range(4))
H100 = 79.0 * GIB  # free on an 80 GB H100 once the CUDA context is up (81,559 MiB in all)


def _setup(name="llama3.1-8b", adapters=R16, **kw) -> MemorySetup:
    return MemorySetup(preset(name), adapters, **kw)


def test_base_weights_count_the_models_parameters_exactly():
    s = _setup()
    m = stage_memory(s, 0, 4096)
    assert m.weights == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count, in bf16
    s70 = _setup("llama3.1-70b", pp=4)
    total = sum(x.weights for x in plan_memory(s70, 4096))
    assert total == 2 * 70_553_706_496  # Llama-3.1-70B


def test_lora_parameters_match_peft_counts_and_shard_under_tp():
    a = AdapterShape(16, independent_a=True)
    # PEFT r=16 all-linear on Llama-3-8B
    assert 32 * lora_params_per_layer(preset("llama3.1-8b"), a) == 41_943_040
    attn = AdapterShape(8, ("linear_qkv",), independent_a=True)
    # q, k, v each an A (8 x 4096) and a B (out x 8)
    assert lora_params_per_layer(preset("llama3.1-8b"), attn) == 3 * 8 * 4096 + 8 * (4096 + 1024 + 1024)
    shared = AdapterShape(8, ("linear_qkv",))  # one A for the fused qkv
    assert lora_params_per_layer(preset("llama3.1-8b"), shared) == 8 * 4096 + 8 * (4096 + 1024 + 1024)
    assert (lora_params_per_layer(preset("llama3.1-8b"), a, tp=2)
            < lora_params_per_layer(preset("llama3.1-8b"), a))


def test_fp8_base_stores_one_byte_per_linear_parameter_plus_scales():
    bf16, fp8 = _setup(), _setup(base_bytes_per_param=1.0, row_scale_bytes=4)
    ratio = base_bytes_per_layer(fp8) / base_bytes_per_layer(bf16)
    assert 0.5 < ratio < 0.502


def test_in_flight_microbatches_1f1b_and_interleaved():
    assert [in_flight(4, s) for s in range(4)] == [4, 3, 2, 1]
    # interleaved 1F1B, v=2: Megatron's warm-up of 2(pp-s-1) + (v-1)pp + 1 model chunks of half a stage
    assert [in_flight(4, s, 2) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]
    s = _setup("llama3.1-70b", pp=4)
    m = plan_memory(s, 4096)
    assert m[0].peak > m[1].peak > m[2].peak  # the same layers, more microbatches in flight


def test_activations_scale_with_tokens_and_shrink_with_recompute():
    s = _setup()
    a, b = stage_memory(s, 0, 4096), stage_memory(s, 0, 8192)
    assert b.per_microbatch == pytest.approx(2 * a.per_microbatch, rel=0.01)
    peaks = [stage_memory(s, 0, 8192, n).peak for n in (0, 8, 16, 32)]
    assert peaks == sorted(peaks, reverse=True)
    full = stage_memory(s, 0, 8192, 32)
    assert full.per_microbatch < b.per_microbatch / 10  # only each layer's input is kept
    # 12 adapters cost their states and their bf16 copies per microbatch, not activations per token
    more = stage_memory(_setup(adapters=R16 * 3), 0, 8192)
    assert more.lora == pytest.approx(3 * b.lora) and more.per_microbatch > b.per_microbatch


def test_tp_and_sequence_parallel_shard_activations():
    base = stage_memory(_setup("llama3.1-70b", pp=4), 0, 4096).per_microbatch
    tp = stage_memory(_setup("llama3.1-70b", pp=4, tp=2), 0, 4096).per_microbatch
    sp = stage_memory(_setup("llama3.1-70b", pp=4, tp=2, sequence_parallel=True), 0, 4096).per_microbatch
    assert sp < tp < base and sp == pytest.approx(base / 2, rel=0.02)


@pytest.mark.parametrize("capacity, measured_gib", [(12288, 73.8), (8192, 55.2), (16384, 92.4)])
def test_committed_coefficients_predict_the_8b_runs_measured_on_an_h100(capacity, measured_gib):
    # scripts/bench_train.py --skip-hf, shipped 8B config (4 adapters r=16), one H100, commit 313fbba;
    # 16,384 tokens on one H200 (docs/BENCHMARKS.md, commit 37a8520)
    m = stage_memory(_setup(rebuilt_inputs=False), 0, capacity, 0, load_coefficients())
    assert abs(m.peak / GIB / measured_gib - 1) < 0.07


@pytest.mark.parametrize("capacity, measured_gib",
                         [(23040, 123.9), (24576, 131.1), (20480, 112.4), (16384, 93.7),
                          (11264, 70.4)])
def test_committed_coefficients_predict_the_shipped_8b_runs_measured_on_an_h200(capacity, measured_gib):
    # docs/results/shipped-8b-auto-h200.json (commit f100dbe, one H200): the shipped 8B config, PEFT's LoRA
    # layout, auto (23,040) and hand-picked capacities without recompute; peak allocated per run. 11,264: the
    # same config's auto choice on one H100 (docs/results/e2e-8b-auto-tuned-h100.json, 70.4 GiB)
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / "configs/llama3.1-8b-4adapters.yaml", check_files=False)
    s = replace(memory_setup(cfg, run_arch(cfg)), rebuilt_inputs=False)  # measured before the rebuild
    assert all(a.independent_a for a in s.adapters)
    m = stage_memory(s, 0, capacity, 0, load_coefficients())
    assert abs(m.peak / GIB / measured_gib - 1) < 0.07


def test_committed_coefficients_predict_the_70b_pp4_stages_measured_on_h200s():
    # docs/BENCHMARKS.md: llama3.1-70b PP=4, 4,096-token microbatches, no recompute, 4x H200:
    # 130/105/82/61 GiB
    m = plan_memory(_setup("llama3.1-70b", pp=4, rebuilt_inputs=False), 4096, 0, load_coefficients())
    for stage, measured in zip(m, (130, 105, 82, 61), strict=True):
        assert abs(stage.peak / GIB / measured - 1) < 0.07, (stage.stage, stage.peak / GIB)


@pytest.mark.parametrize("stage_layers, recompute, measured",
                         [((33, 31), 16, (103, 64)), (None, 32, (42, 42))])
def test_committed_coefficients_predict_the_32b_pp2_stages_measured_on_h200s(stage_layers, recompute,
                                                                           measured):
    # docs/BENCHMARKS.md, Qwen2.5-32B PP=2 on 2x H200, 8,192 tokens: 103 / 64 GiB with 16 layers recomputed
    # per stage (stages of 33/31 layers); 42 GiB per GPU with every layer recomputed (the larger stage)
    m = plan_memory(_setup("qwen2.5-32b", pp=2, stage_layers=stage_layers, rebuilt_inputs=False), 8192,
                    recompute, load_coefficients())
    assert abs(m[0].peak / GIB / measured[0] - 1) < 0.07
    if stage_layers:
        assert abs(m[1].peak / GIB / measured[1] - 1) < 0.07


@pytest.mark.parametrize("raw_file, n_points", [("memory-raw-h100-e953d53.json", 80),
                                                 ("memory-raw-h200-f100dbe.json", 27)])
def test_every_calibration_point_is_predicted_within_7_percent(raw_file, n_points):
    """docs/results/memory-raw-*.json (scripts/calibrate_memory.py on an H100 80GB and an H200, the current
    LoRA layout): each point's peak allocated memory against the committed model (fitted on the H100's
    2k/8k/16k points; the H200's points all held out), and each point that ran out of memory predicted not to
    fit."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from calibrate_memory import label_attention, predict

    raw = json.loads((ROOT / "docs/results" / raw_file).read_text())
    label_attention(raw)  # the H100 grid ran per-sample attention from its first out-of-memory point on
    c = load_coefficients()
    assert len(raw["points"]) >= n_points
    for p in raw["points"]:
        pred = predict(p, c)
        if p.get("oom"):
            assert pred * (1 + c.margin_frac) + c.margin_bytes > raw["gpu_total_bytes"], p
        else:
            assert abs(pred / p["peak_allocated"] - 1) < 0.07, p
            # the margin covers it
            assert pred * (1 + c.margin_frac) + c.margin_bytes >= p["peak_reserved"], p


def test_attention_paths_save_what_the_probe_counted():
    # scripts/count_saved_bytes.py (saved-tensor hooks on the model code, CPU): per token and layer the
    # per-sample SDPA path keeps one q-width tensor more than the varlen op (its per-sample outputs beside
    # their concatenation); the varlen op with k, v expanded keeps rotated q, k, v and the output (4q); given
    # grouped k, v it keeps qkv's output (v is a view), the rotated q and k and the output
    s = _setup()  # 8B: q = 32 x 128, g = 8 x 128
    q, g = 4096, 1024
    assert attention_elems(s) == 4 * q  # the default: torch 2.11's varlen_attn has no enable_gqa
    assert attention_elems(replace(s, attention="varlen-gqa")) == 3 * q + 3 * g
    assert attention_elems(replace(s, attention="per-sample")) - attention_elems(s) == q
    # FlashAttention-4 is given grouped k, v (v copied: qkv's output is not kept) and keeps its fp32
    # log-sum-exp per head
    assert attention_elems(replace(s, attention="fa4")) == 2 * q + 2 * g + 32 * 2
    # default coefficients: act_scale 1
    per_sample = stage_memory(replace(s, attention="per-sample"), 0, 8192)
    assert per_sample.peak - stage_memory(s, 0, 8192).peak == pytest.approx(8192 * 32 * q * 2, rel=1e-9)
    with pytest.raises(ValueError, match="attention"):
        attention_elems(replace(s, attention="flash"))


def test_calibration_points_after_the_first_oom_are_labelled_per_sample():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from calibrate_memory import label_attention

    raw = {"points": [{"capacity": 8192}, {"capacity": 16384, "oom": True}, {"capacity": 2048},
                      {"capacity": 4096, "attention": "varlen"}]}
    label_attention(raw)
    assert [p["attention"] for p in raw["points"]] == ["varlen", "varlen", "per-sample", "varlen"]


@pytest.mark.parametrize("capacity", [2048, 8192, 20480, 24576])
@pytest.mark.parametrize("count", [1, 4, 12])
def test_calibration_batches_give_every_adapter_a_sample(capacity, count):
    # 4 adapters at 8,192 tokens (6 samples) used to leave one adapter without a sample, hence without
    # gradients
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from calibrate_memory import _samples

    names = [f"a{i}" for i in range(count)]
    got = _samples(capacity, names)
    order = [a for a, _ in got]
    assert sum(n for _, n in got) == capacity and set(order) == set(names)
    assert order == sorted(order, key=names.index)  # contiguous per adapter


def test_auto_picks_the_largest_capacity_that_fits_without_recompute_when_it_can():
    c = load_coefficients()
    p80 = choose(_setup(), H100, 4096, coeffs=c)
    assert p80.fits and p80.recompute_layers == [0] and p80.capacity >= 8192
    bigger = choose(_setup(), p80.capacity, 4096, capacity=p80.capacity + 512, recompute=0, coeffs=c)
    assert not bigger.fits  # one step more does not fit: the largest
    p141 = choose(_setup(), 139 * GIB, 4096, coeffs=c)
    assert p141.capacity > p80.capacity
    small = choose(_setup(), 24 * GIB, 4096, coeffs=c)  # bf16 8B on a 24 GB card: only with recompute
    assert small.fits and small.recompute_layers[0] > 0 and small.capacity >= 4096


def test_recompute_auto_is_the_fewest_layers_per_stage_that_fit():
    c = load_coefficients()
    s = _setup("llama3.1-70b", pp=4)
    p = choose(s, H100, 4096, capacity=4096, recompute="auto", coeffs=c)
    assert p.fits and p.recompute_layers[0] >= p.recompute_layers[-1]
    for k, n in enumerate(p.recompute_layers):
        if n:
            assert not stage_memory(s, k, 4096, n - 1, c).fits(H100)


def test_nothing_fits_names_the_stage_and_the_job_and_what_would():
    s = _setup("llama3.1-70b", pp=4)
    p = choose(s, 40 * GIB, 4096, coeffs=load_coefficients())
    assert not p.fits
    msg = no_fit_message(s, p, {"short": 512, "long": 4096}, "run.yaml", load_coefficients())
    assert msg.startswith("run.yaml: the run does not fit 40.0 GiB") and "pipeline stage 0 needs" in msg
    assert "job 'long'" in msg and "parallelism.pp: 8" in msg
    # advice is only what the model says fits: at 32 GiB not pp 8 (it would not fit either) but 16; at 24
    # nothing
    for gib, advice in ((32, "parallelism.pp: 16"), (24, "Nothing within this run's settings fits")):
        p = choose(s, gib * GIB, 4096, coeffs=load_coefficients())
        msg = no_fit_message(s, p, {"short": 512, "long": 4096}, "run.yaml", load_coefficients())
        assert advice in msg and "parallelism.pp: 8" not in msg, msg
    # a model far below the fitted data (`plan --gpu-memory 1` of the quickstart): its peak is never shown
    # below 0
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / "configs/quickstart.yaml", check_files=False)
    plan = resolve(cfg, World.for_plan(cfg), GpuMemory(GIB, GIB), coeffs=load_coefficients())
    shown = "\n".join([*plan.lines(), plan.no_fit or ""])
    assert not plan.fits and "predicted peak 0.0 GiB" in shown and "peak -" not in shown, shown


@pytest.mark.parametrize("gpus", [4, 8])
def test_shipped_70b_config_plan_fits_h100_80gb(gpus):
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / "configs/llama3.1-70b-4adapters.yaml", [f"parallelism.dp={gpus // 4}"],
                          check_files=False)
    plan = resolve(cfg, World.for_plan(cfg), GpuMemory(H100, H100), coeffs=load_coefficients())
    assert plan.fits, "\n".join(plan.lines())
    assert plan.dp == gpus // 4 and {"token_capacity", "recompute_layers"} <= set(plan.auto)
    # the config unchanged
    assert cfg.scheduler.token_capacity == "auto" and cfg.model.recompute_layers == "auto"


@pytest.mark.parametrize("config", ["llama3.1-8b-4adapters", "qwen2.5-32b-4adapters"])
def test_shipped_configs_fit_80_and_141_gb(config):
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / f"configs/{config}.yaml", check_files=False)
    for size in (H100, 139 * GIB):
        assert resolve(cfg, World.for_plan(cfg), GpuMemory(size, size), coeffs=load_coefficients()).fits


def test_the_memory_plan_says_why_it_recomputes_and_what_the_alternatives_cost():
    """8B at 24 GiB: full recompute at 6,144 tokens; at 48 GiB: none at 5,120. Each plan says why: nothing
    fits without recompute at 24 GiB, and the alternatives' predicted time per token."""
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / "configs/llama3.1-8b-4adapters.yaml", check_files=False)
    small, large = ("\n".join(resolve(cfg, World(1), GpuMemory(gib * GIB, gib * GIB)).lines())
                    for gib in (24, 48))
    assert "  without recompute: nothing fits (at 4096 tokens a stage needs" in small
    assert "without recompute" not in large  # its plan recomputes nothing
    for text in (small, large):
        lines = text.splitlines()
        why = lines[lines.index(next(x for x in lines if "why:" in x)) + 1:]
        rows = [x for x in why if x.startswith("    token_capacity ")]
        assert rows and all(float(x.rsplit(": ", 1)[1].split("x")[0]) >= 1.0 for x in rows)
        assert "(the run's split)" not in text  # one stage: no split to name


def test_parse_bytes():
    assert parse_bytes("80GiB") == parse_bytes("80GB") == parse_bytes("80") == 80 * GIB
    assert parse_bytes("81920MiB") == 80 * GIB
    for bad in ("lots", "-3GiB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_workspace_and_margin_come_from_the_committed_file():
    c = load_coefficients()
    assert "calibrate_memory" in c.source and 0 < c.margin_frac < 0.2
    assert replace(c, margin_frac=0.0).margin_frac == 0.0


def test_run_config_fp8_base_and_virtual_stages_reach_the_model():
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / "configs/llama3.1-70b-4adapters.yaml", ["model.base_precision=fp8",
                                                                          "parallelism.virtual_stages=2"],
                          check_files=False)
    s = memory_setup(cfg, preset("llama3.1-70b"))
    assert s.base_bytes_per_param == 1.0 and s.row_scale_bytes == 4 and s.virtual_stages == 2
    # stage_layers: auto, the loss-aware split (per rank, V chunks summed): the bf16 output layer and loss
    # weigh 3.1 FP8 layers (stage_costs.json: 2.47 bf16 layers, an FP8 layer 0.80 of a bf16 one)
    assert s.stage_layers == (21, 21, 21, 17)
    bf16 = memory_setup(load_run_config(ROOT / "configs/llama3.1-70b-4adapters.yaml", check_files=False),
                          preset("llama3.1-70b"))
    assert s.layers(2) == bf16.layers(2) == 21
    w8, w16 = stage_memory(s, 2, 4096).weights, stage_memory(bf16, 2, 4096).weights
    assert 0.5 < w8 / w16 < 0.51  # a middle stage holds decoder linears only (and norms)
    assert stage_memory(s, 0, 4096).in_flight == 5.5 and stage_memory(bf16, 0, 4096).in_flight == 4


def test_reference_kernels_save_what_the_fused_ones_save_and_predict_their_h100_run():
    # docs/results/e2e-8b-auto-tuned-h100.json (commit 5f4036c): kernels=reference at its auto capacity 7,680
    # peaked at 54.8 GiB on one H100 (68.3 predicted while the model counted a dropped input per linear, which
    # the torch path does not keep).
    # The setup has no LoRA-impl field: both impls save the same tensors, so one prediction serves both.
    c = load_coefficients()
    assert abs(stage_memory(_setup(rebuilt_inputs=False), 0, 7680, 0, c).peak / GIB / 54.8 - 1) < 0.07


def _70b_setup(**kw):
    from lorafusion.config import load_run_config

    cfg = load_run_config(ROOT / "configs/llama3.1-70b-4adapters.yaml",
                          ["parallelism.dp=1", *kw.get("ov", [])], check_files=False)
    return cfg, memory_setup(cfg, preset("llama3.1-70b"))


def test_memory_balanced_split_beats_the_compute_split_on_an_80gb_pipeline():
    """1F1B holds 4 microbatches on stage 0 and 1 on stage 3: the split chosen with the recompute gives the
    early stages fewer layers, every stage fits, and the busiest rank's work (recompute included) is the
    least."""
    from lorafusion.scheduler.sizing import rank_loads, choose

    cfg, s = _70b_setup()
    gpu = 78.7 * GIB
    plan = choose(s, gpu, 4096, split="auto", coeffs=load_coefficients(), chunk_tokens=1e6)
    assert plan.fits and plan.chosen["stage_layers"] and sum(plan.stage_layers) == 80
    assert plan.stage_layers[0] < plan.stage_layers[-1]  # stage 0 holds the most in flight
    kept = choose(s, gpu, 4096, split=None, coeffs=load_coefficients(), chunk_tokens=1e6)
    assert kept.stage_layers is None and kept.fits and kept.cost > plan.cost
    balanced = max(rank_loads(replace(s, stage_layers=tuple(plan.stage_layers)), plan.recompute_layers))
    assert balanced < max(rank_loads(s, kept.recompute_layers))
    # no other split at this capacity does better: every 3-layer move off or onto a stage is worse or does not
    # fit
    assert any(a["what"] == "the run's split" for a in plan.alternatives)
    assert all(a["cost"] >= plan.cost for a in plan.alternatives) and plan.why()


def test_memory_balanced_split_is_exhaustively_optimal_on_a_small_search():
    """Against every split of the 70B's 80 layers within 3 layers of the chosen one (fewest recompute
    each)."""
    from itertools import product

    from lorafusion.scheduler.sizing import _balanced_split, _fewest, rank_loads

    _, s = _70b_setup()
    gpu, c = 78.7 * GIB, load_coefficients()
    split = _balanced_split(s, 4096, gpu, c)
    best = max(rank_loads(replace(s, stage_layers=tuple(split)),
                      [_fewest(replace(s, stage_layers=tuple(split)), k, 4096, gpu, c) for k in range(4)]))
    for d in product(range(-3, 4), repeat=3):
        other = [split[0] + d[0], split[1] + d[1], split[2] + d[2]]
        other.append(80 - sum(other))
        so = replace(s, stage_layers=tuple(other))
        rc = [_fewest(so, k, 4096, gpu, c) for k in range(4)]
        if min(other) >= 1 and None not in rc:
            assert max(rank_loads(so, rc)) >= best - 1e-9, other


def test_a_fixed_split_or_recompute_is_kept():
    from lorafusion.scheduler.sizing import choose

    _, s = _70b_setup()
    plan = choose(s, 78.7 * GIB, 4096, split=[18, 20, 21, 21], recompute="auto", coeffs=load_coefficients())
    assert plan.stage_layers is None and not plan.chosen["stage_layers"]
    plan = choose(s, 141 * GIB, 4096, split="auto", recompute=0, coeffs=load_coefficients())
    assert plan.stage_layers is None  # the split is balanced with the recompute only when both are auto


def test_out_of_memory_advice_fits_the_corrected_model_and_the_config():
    """The 70B's stage 1 ran out of memory 0.8 GiB above its prediction: each piece of advice is a setting the
    config accepts (a capacity >= the longest sample, one recompute count for all stages), not the one the run
    had, and fits every stage once the model is corrected by the miss."""
    import re

    from lorafusion.scheduler.sizing import oom_advice

    _, s = _70b_setup()
    plan = choose(s, 78.7 * GIB, 4096, split="auto", coeffs=load_coefficients(), chunk_tokens=1e6)
    actual = plan.stages[1].peak + 0.8 * GIB
    advice = oom_advice(s, plan, 1, actual, 4096, load_coefficients())
    assert advice and all("stage_layers: " + str(plan.stage_layers) in a for a in advice)
    budget = plan.gpu_bytes - 1.3 * GIB
    split = replace(s, stage_layers=tuple(plan.stage_layers))
    for a in advice:
        cap = int(re.search(r"token_capacity: (\d+)", a).group(1))
        assert cap >= 4096
        m = re.search(r"recompute_layers: (\d+)", a)
        rc = ([min(int(m.group(1)), split.layers(k)) for k in range(4)] if m
              else [split.layers(k) for k in range(4)])
        assert rc != plan.recompute_layers or cap != plan.capacity
        assert all(st.fits(budget) for st in plan_memory(split, cap, rc, load_coefficients()))
