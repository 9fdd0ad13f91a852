"""The memory plan in a run, on CPU with the GPU's memory given (``runtime.gpu_memory.gpu_free_bytes``
patched): ``auto`` resolved, printed and recorded in summary.json; a run that cannot fit refused in one line
before anything is written; a runtime out-of-memory one line naming the stage, with the checkpoints already
written intact; ``lorafusion plan --gpu-memory``; ``recompute_layers: auto`` in the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorafusion.core.errors import ConfigError
from runtime_utils import job_dict, train_inprocess, write_dataset, write_run

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


def _main(*args) -> int:
    from lorafusion.cli import main

    return main([str(a) for a in args])


def _gpu(monkeypatch, free_gib: float, total_gib: float = 80.0) -> None:
    import lorafusion.runtime.gpu_memory as gpu_memory

    monkeypatch.setattr(gpu_memory, "gpu_free_bytes", lambda: (free_gib * GIB, total_gib * GIB))


def _run(tmp: Path, *, steps=2, save_every=None, capacity="auto", recompute_layers="auto") -> Path:
    jobs = [job_dict("a", write_dataset(tmp / "a.jsonl", 1), r=4, steps=steps, save_every=save_every),
            job_dict("b", write_dataset(tmp / "b.jsonl", 2), r=8, steps=steps)]
    return write_run(tmp, jobs, capacity=capacity, recompute=True, recompute_layers=recompute_layers)


def test_auto_is_resolved_printed_and_recorded(tmp_path, megatron_single, monkeypatch, capsys):
    _gpu(monkeypatch, 8.0)
    summary, out = train_inprocess(_run(tmp_path))
    plan = json.loads((out / "summary.json").read_text())["memory_plan"]
    assert plan == summary["memory_plan"] and plan["fits"]
    assert plan["auto"] == {"token_capacity": True, "recompute_layers": True, "stage_layers": False}
    # a tiny model: no recompute needed
    assert plan["token_capacity"] >= 64 and plan["recompute_layers"] == [0]
    assert plan["stages"][0]["predicted_peak_gib"] < plan["gpu_memory_gib"]
    err = capsys.readouterr().err
    assert ("memory plan for 8.0 GiB free of 80.0 GiB" in err
            and f"token_capacity {plan['token_capacity']} (auto)" in err)
    assert summary["run_plan"]["token_capacity"] == plan["token_capacity"]
    assert summary["run_plan"]["memory_plan"] == plan


def test_cpu_keeps_todays_auto(tmp_path, megatron_single, capsys):
    summary, _ = train_inprocess(_run(tmp_path))  # no CUDA here: no memory to read
    assert summary["memory_plan"] is None and "memory plan" not in capsys.readouterr().err
    # the cost model's capacity at the longest max_seq_len, every layer recomputed
    # (tiny-llama: 4 layers)
    assert summary["run_plan"]["token_capacity"] == 5120 and summary["run_plan"]["recompute_layers"] == [4]


def test_a_run_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, megatron_single, monkeypatch,
                                                                     capsys):
    _gpu(monkeypatch, 0.5)  # less than the margin the plan keeps free
    run = _run(tmp_path)
    assert _main("train", run) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorafusion train: error: ") and "Traceback" not in err
    assert ("does not fit 0.5 GiB of GPU memory" in err and "pipeline stage 0 needs" in err
            and "job 'a'" in err)
    assert not (tmp_path / "out").exists()


def test_runtime_out_of_memory_is_one_line_and_keeps_checkpoints(tmp_path, megatron_single,
                                                                 monkeypatch, capsys):
    import lorafusion.runtime.pipeline as pipeline

    _gpu(monkeypatch, 8.0)
    real, calls = pipeline.run_chunk, []

    def run_chunk(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "run_chunk", run_chunk)
    run = _run(tmp_path, steps=6, save_every=1, capacity=256, recompute_layers=None)
    assert _main("train", run, "scheduler.lookahead_batches=1") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("lorafusion: memory plan")  # the plan, then the error
    errors = [x for x in err.splitlines() if x.startswith("lorafusion train: error: ")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n")
    assert "pipeline stage 0 ran out of GPU memory in chunk 2" in errors[0]
    assert "the memory model predicted a peak of" in errors[0] and "token_capacity 256" in errors[0]
    assert ("Lower scheduler.token_capacity (e.g. 256)" not in errors[0]
            and "model.recompute_layers" in errors[0])
    step = tmp_path / "out" / "checkpoints" / "a" / "step_000001"
    assert step.is_dir() and not list(step.parent.glob("*.tmp*"))  # written before the failure, complete
    # and still loads: `lorafusion export` of that step writes a PEFT adapter
    assert _main("export", step, "--job", "a", "--out", tmp_path / "exported") == 0


def test_plan_gpu_memory_prints_every_size(capsys):
    cfg = ROOT / "configs/llama3.1-70b-4adapters.yaml"
    assert _main("plan", cfg, "--gpu-memory", "24,48,80,141") == 0
    out = capsys.readouterr().err
    assert out.count("memory plan for ") == 4 and "memory plan for 80.0 GiB free of 80.0 GiB per GPU" in out
    blocks = out.split("memory plan for ")[1:]
    # 24 GiB: not even the weights, and no deeper pipeline the memory model would fit either: said so
    assert "does NOT fit" in blocks[0] and "Nothing within this run's settings fits" in blocks[0]
    assert "parallelism.pp: 8" not in blocks[0]
    assert blocks[2].rstrip().endswith("fits") and "token_capacity 4096 (auto)" in blocks[2]
    assert ("recompute_layers per stage [" in blocks[2] and "] (auto)" in blocks[2]
            and "stage_layers [" in blocks[2])
    assert blocks[2].count("\n      ") >= 4  # one row per stage


def test_plan_gpu_memory_says_what_would_fit_a_fixed_setting(capsys):
    cfg = ROOT / "configs/llama3.1-8b-4adapters.yaml"
    assert _main("plan", cfg, "scheduler.token_capacity=24576", "model.recompute=false",
                 "model.recompute_layers=null", "--gpu-memory", "80GiB") == 0
    out = capsys.readouterr().err
    assert "does NOT fit" in out and "Would fit: scheduler.token_capacity: " in out
    assert "model.recompute_layers: " in out


def test_plan_gpu_memory_bad_size(capsys):
    assert _main("plan", ROOT / "configs/llama3.1-8b-4adapters.yaml", "--gpu-memory", "lots") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpu-memory: expected a memory size" in err


def test_recompute_layers_auto_in_the_schema():
    from lorafusion.config.schema import ModelConfig

    assert ModelConfig(preset="tiny-llama", recompute=True,
                       recompute_layers="auto").recompute_layers == "auto"
    with pytest.raises(ValueError, match="needs recompute: true"):
        ModelConfig(preset="tiny-llama", recompute_layers="auto")
    with pytest.raises(ValueError, match="an integer >= 1 or 'auto'"):
        ModelConfig(preset="tiny-llama", recompute=True, recompute_layers="some")
    assert issubclass(ConfigError, ValueError)


def test_recompute_kwargs_per_stage():
    """The model builder's recompute per pipeline rank comes from the plan: the memory plan's counts for auto
    (none: off; all: every layer; Megatron counts per model chunk: rounded up), every layer without a GPU, the
    config's own count otherwise."""
    from lorafusion.config import load_run_config
    from lorafusion.resolve import GpuMemory, World, resolve

    config = ROOT / "configs/llama3.1-70b-4adapters.yaml"
    cfg = load_run_config(config, check_files=False)
    plan = resolve(cfg, World(4), GpuMemory(80 * GIB, 80 * GIB))
    n, layers = plan.recompute_layers, plan.layers_per_rank
    # some layers on early stages, none on the last
    assert 0 < n[1] < layers[1] and n[3] == 0 and n[0] >= n[1]
    assert [plan.recompute_kwargs(k) for k in range(4)] == [
        {"recompute": True, "recompute_layers": n[0]}, {"recompute": True, "recompute_layers": n[1]},
        {"recompute": True, "recompute_layers": n[2]}, {"recompute": False, "recompute_layers": None}]
    assert resolve(cfg, World(4), None).recompute_kwargs(0) == {"recompute": True, "recompute_layers": None}
    v2 = resolve(load_run_config(config, ["parallelism.virtual_stages=2"], check_files=False), World(4),
                 GpuMemory(80 * GIB, 80 * GIB))
    assert [v2.recompute_kwargs(k)["recompute_layers"] for k in range(4)] == \
        [None if m in (0, v2.layers_per_rank[k]) else -(-m // 2) for k, m in enumerate(v2.recompute_layers)]
    fixed = load_run_config(config, ["model.recompute_layers=5"], check_files=False)
    assert resolve(fixed, World(4), GpuMemory(80 * GIB, 80 * GIB)).recompute_kwargs(3) == \
        {"recompute": True, "recompute_layers": 5}
