"""model.base_precision: fp8 through the CLI on CPU (torch._scaled_mm): a tiny run trains, generates with the
FP8 base as training did, exports the adapter merged into the *original* bf16 weights (and says so), refuses a
resume with another base precision, and a bad config is one clear error."""

from __future__ import annotations

import json

import pytest
import torch

from runtime_utils import job_dict, three_job_dicts, train_inprocess, write_dataset, write_run


def _main(*args) -> int:
    from lorafusion.cli import main

    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("fp8run")
    job = job_dict("a", write_dataset(tmp / "d" / "a.jsonl", 1, rows=8), r=4, steps=2, lr=5e-2, dropout=0.1,
                   save_every=1)
    run = write_run(tmp, [job], capacity=96, base_precision="fp8")
    assert _main("train", run) == 0
    return tmp, run, tmp / "out"


def test_fp8_run_trains_and_records_its_base(fp8_run):
    _, _, out = fp8_run
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("job") == "a" and "loss" in r]
    assert len(steps) == 2 and all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in steps)
    record = json.loads((out / "base_model.json").read_text())
    assert record["base_precision"] == "fp8" and record["dtype"] == "bfloat16"
    assert (out / "adapters" / "a" / "adapter_model.safetensors").is_file()


def test_generate_uses_the_fp8_base(fp8_run, tmp_path, megatron_single):
    from lorafusion.inference.generate import build_run_model, load_run

    _, _, out = fp8_run
    info = load_run(out)
    assert info.base_precision == "fp8"
    model = build_run_model(info, ["a"])
    from lorafusion.layers import lora_modules

    from lorafusion.layers.fp8_base import BF16_LEADING_LAYERS

    mods = [mod for _, mod in lora_modules(model)]
    assert all((mod.weight is None and mod.weight_fp8 is not None) == (mod.layer_number > BF16_LEADING_LAYERS)
               for mod in mods)
    assert sum(mod.weight is None for mod in mods) > len(mods) // 2
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "reverse abc:", "job": "a"}) + "\n")
    assert _main("generate", out, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "g.jsonl",
                 "--max-new-tokens", 4) == 0
    row = json.loads((tmp_path / "g.jsonl").read_text())
    assert len(row["output_ids"]) >= 1


def test_merged_export_uses_the_original_weights_and_says_so(fp8_run, tmp_path, capsys):
    from safetensors.torch import load_file

    _, _, out = fp8_run
    assert _main("export", out, "--base", "--out", tmp_path / "base") == 0
    err = capsys.readouterr().err
    assert "the run trained on an FP8 base; these are the original bfloat16 weights" in err
    assert _main("export", out, "--job", "a", "--merged", "--out", tmp_path / "merged", "--json") == 0
    msg = json.loads(capsys.readouterr().out)
    assert (msg["kind"] == "merged"
            and "original bfloat16 weights, reloaded from preset 'tiny-llama'" in msg["exported"])
    base, merged = (load_file(tmp_path / "base" / "model.safetensors"),
                    load_file(tmp_path / "merged" / "model.safetensors"))
    ad = load_file(out / "adapters" / "a" / "adapter_model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight"
    a = ad["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].float()
    b = ad["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].float()
    want = (base[key].float() + 2.0 * (b @ a)).to(torch.bfloat16)  # alpha 8 / r 4
    assert base[key].dtype == torch.bfloat16 and torch.equal(merged[key], want)


def test_resume_with_another_base_precision_is_refused(fp8_run, capsys):
    _, run, _ = fp8_run
    assert _main("train", run, "--resume", "model.base_precision=bf16") == 2
    err = capsys.readouterr().err
    assert "model.base_precision: cannot resume job 'a'" in err and "'fp8'" in err


def test_fp8_needs_bfloat16(tmp_path, capsys):
    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4)], out="never")
    assert _main("train", run, "model.base_precision=fp8") == 2
    err = capsys.readouterr().err
    assert ("model: base_precision: fp8 needs dtype: bfloat16" in err
            or "base_precision: fp8 needs dtype: bfloat16" in err)
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------ TP + SP and PP +
# recompute
FP8_LAYOUTS = {"tp2_sp_fp8": dict(tp=2, sequence_parallel=True),
               "pp2_recompute_fp8": dict(pp=2, recompute=True)}


@pytest.fixture(scope="module")
def fp8_single(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("fp8single")
    return train_inprocess(write_run(tmp, three_job_dicts(tmp), out="one", base_precision="fp8"))[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.two_process(name, jobs=three_job_dicts,
                                                     guard=bool(layout.get("pp")),
                                                     base_precision="fp8", **layout))
    for name, layout in FP8_LAYOUTS.items()])
def test_two_process_fp8_runs_equal_one_process(fp8_single, two_process, name):
    """The FP8 base under TP=2 + SP and PP=2 + recompute trains as one process does. A job's first step runs
    its initial adapter (B = 0: the loss is the base model's): PP and recompute change no operand, so it
    agrees to bf16 rounding; under TP the row-parallel linears quantize each rank's in-dim shard of X with its
    own row scales (one process: the whole row), so TP agrees to FP8 precision. Later steps add bf16 training
    noise, which FP8 rounding flips amplify: with the first layer bf16 (the default) one later step's gradient
    norm of 59 tokens moved by 5.6% under TP=2 + SP (its loss by 0.07%; every other step within 1.4%)."""
    two = two_process(name)
    first_rel = 1e-2 if "tp2" in name else 1e-3
    key = lambda r: (r["job"], r["step"])  # noqa: E731
    ours = sorted((json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()), key=key)
    ref = sorted((json.loads(x) for x in (fp8_single / "metrics.jsonl").read_text().splitlines()), key=key)
    ours, ref = [r for r in ours if "loss" in r], [r for r in ref if "loss" in r]
    assert [key(r) for r in ours] == [key(r) for r in ref] and ours
    for a, b in zip(ours, ref):
        first = a["step"] == 1
        assert a["loss"] == pytest.approx(b["loss"], rel=first_rel if first else 2e-2), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5 * first_rel if first else 8e-2), (a, b)
    assert json.loads((two / "base_model.json").read_text())["base_precision"] == "fp8"


def test_memory_model_counts_the_fp8_base_70b_pp2_fits_80gib(tmp_path):
    """The memory model (scheduler/sizing) reads model.base_precision: the shipped 70B config at PP=2 on 80
    GiB GPUs (its jobs at their dataset.max_seq_len) fits with the FP8 base and does not with bf16
    (`lorafusion plan --gpu-memory 80GiB ... parallelism.pp=2 model.base_precision=fp8`)."""
    from pathlib import Path

    from lorafusion.config import load_run_config
    from lorafusion.resolve import GpuMemory, World, resolve
    from lorafusion.scheduler.memory import GIB

    data = [f"jobs.{i}.dataset.path={write_dataset(tmp_path / f'{i}.jsonl', i)}" for i in range(4)]
    config = Path(__file__).resolve().parents[2] / "configs" / "llama3.1-70b-4adapters.yaml"
    fits = {}
    for precision in ("bf16", "fp8"):
        cfg = load_run_config(config, [*data, "parallelism.pp=2", "parallelism.dp=1",
                                        f"model.base_precision={precision}",
                                        f"output_dir={tmp_path / precision}"])
        plan = resolve(cfg, World.for_plan(cfg), GpuMemory(80 * GIB, 80 * GIB))
        fits[precision] = plan.fits
        weights = [float(x.split()[4]) for x in plan.lines()[2:4]]  # the stages' weight GiB
        assert (precision == "fp8") == (max(weights) < 40), plan.lines()
    assert fits == {"bf16": False, "fp8": True}


def test_memory_model_counts_the_first_layer_kept_in_bf16():
    """With an FP8 base the first decoder layer keeps its bf16 linears (lorafusion.core.precision): the memory
    model adds them to stage 0 only, one layer's linear parameters at 2 bytes instead of 1 (plus no
    scales)."""
    from dataclasses import replace

    from lorafusion.core.arch import preset
    from lorafusion.scheduler.memory import AdapterShape, MemorySetup, stage_weights

    arch = preset("llama3.1-8b")
    s = MemorySetup(arch, (AdapterShape(16, ("all-linear",), 0.1),), base_bytes_per_param=1.0,
                    row_scale_bytes=4, pp=2)
    kept = replace(s, bf16_base_layers=1)
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.kv_channels + 2 * arch.num_query_groups * arch.kv_channels
    params = h * q + arch.num_attention_heads * arch.kv_channels * h + h * 2 * f + f * h
    scales = 4 * (q + h + 2 * f + h)
    assert stage_weights(kept, 0) - stage_weights(s, 0) == pytest.approx(params - scales)
    assert stage_weights(kept, 1) == stage_weights(s, 1)
    # bf16 base: nothing to add
    assert stage_weights(replace(kept, base_bytes_per_param=None, row_scale_bytes=0), 0) == \
        stage_weights(replace(s, base_bytes_per_param=None, row_scale_bytes=0), 0)
