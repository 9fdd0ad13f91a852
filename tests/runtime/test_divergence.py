"""A job whose steps are not finite skips them, is paused as diverged after max_nonfinite_steps in a row,
keeps its last finite weights as its export, and harms no other job; metrics.jsonl stays strict JSON."""

import json

import pytest
import torch

from runtime_utils import assert_close, load_adapter, three_job_dicts, train_inprocess, write_run


def _strict_rows(out):
    def no_constants(c):
        raise AssertionError(f"bare {c} in metrics.jsonl")

    return [json.loads(line, parse_constant=no_constants)
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_diverging_job_is_skipped_paused_and_harms_no_other(tmp_path, megatron_single, capsys):
    jobs = three_job_dicts(tmp_path)
    for j in jobs:
        j["max_steps"] = 8
    ref_sum, ref = train_inprocess(write_run(tmp_path, jobs, out="ref", name="ref.yaml"))
    bad = [dict(j) for j in jobs]
    bad[1] = dict(bad[1], optimizer=dict(bad[1]["optimizer"], lr=10.0, max_grad_norm=None, warmup_steps=0),
                  lora=dict(bad[1]["lora"], lora_alpha=1e6))  # (the largest lr and alpha the config takes)
    summary, out = train_inprocess(write_run(tmp_path, bad, out="bad", name="bad.yaml"))
    text = capsys.readouterr().err
    assert summary["jobs"]["up"]["status"] == "diverged"
    assert "job up: diverged" in text and "step" in text and "skipped" in text
    assert {summary["jobs"][n]["status"] for n in ("rev", "rev2")} == {"done"}
    rows = _strict_rows(out)
    up = [r for r in rows if r["job"] == "up"]
    skipped = [r["step"] for r in up if r["skipped"]]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
    assert up[-1]["step"] == skipped[-1] == summary["jobs"]["up"]["steps"] < 8
    assert all(r["loss"] is None or r["grad_norm"] is None for r in up if r["skipped"])
    # the export is the last finite state: finite, and the checkpoint taken at the pause holds the same
    # weights
    exported = load_adapter(out, "up")
    assert all(torch.isfinite(t).all() for t in exported.values())
    ckpt = out / "checkpoints" / "up" / (out / "checkpoints" / "up" / "latest").read_text().strip()
    from safetensors.torch import load_file
    saved = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
    # the other jobs: finite, never skipped, and as trained next to a healthy job (packing may differ once the
    # diverged job is gone, so fp32 summation-order noise only)
    ref_rows = {(r["job"], r["step"]): r for r in _strict_rows(ref)}
    for r in rows:
        if r["job"] != "up":
            assert not r["skipped"] and r["loss"] is not None and r["grad_norm"] is not None
            assert r["loss"] == pytest.approx(ref_rows[r["job"], r["step"]]["loss"], rel=1e-5)
            assert r["grad_norm"] == pytest.approx(ref_rows[r["job"], r["step"]]["grad_norm"], rel=1e-4)
    for name in ("rev", "rev2"):
        assert_close(load_adapter(out, name), load_adapter(ref, name), rel=1e-4)
        assert summary["jobs"][name]["final_loss"] == pytest.approx(
            ref_sum["jobs"][name]["final_loss"], rel=1e-5)


def test_nonfinite_gradient_leaves_weights_and_moments_untouched(megatron_single):
    from lorafusion.runtime.optim import AdapterOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = AdapterOptimizer(params, lr=0.1, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                           schedule="constant",
                           warmup_steps=0, total_steps=10, min_lr_ratio=0.0, max_grad_norm=1.0)
    for bad in (True, False, True):  # before the first step (no moments yet) and after one
        before = [p.detach().clone() for p in params]
        moments = [{k: v.clone() for k, v in opt.opt.state[p].items() if k != "step"} for p in params]
        for p in params:
            p.grad = torch.randn_like(p)
        if bad:
            params[0].grad[1, 2] = float("nan")
        norm, _ = opt.step()
        changed = [not torch.equal(p, b) for p, b in zip(params, before)]
        if bad:
            assert norm != norm and not any(changed)
            for p, m in zip(params, moments):
                state = {k: v for k, v in opt.opt.state[p].items() if k != "step"}
                assert all(torch.equal(state[k], m.get(k, torch.zeros_like(v))) for k, v in state.items())
        else:
            assert all(changed)
