"""Helpers of the speed benchmark scripts that decide what a GPU run reports: the tuner's check that a
candidate block config computes what the default config computes, and the model-step bench's settings."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_model_step  # noqa: E402
import tune_kernels  # noqa: E402


def test_tuner_check_compares_each_output_part_on_its_own_scale():
    ref = tune_kernels._parts((torch.randn(64, 16), [torch.randn(40, 16) * 1e3, None, torch.randn(40, 16)]))
    assert len(ref) == 3  # dS and the two slots that have rows
    assert not tune_kernels.differs([t.clone() for t in ref], ref)
    assert not tune_kernels.differs([t * (1 + 1e-3) for t in ref], ref)  # fp32 summation order, bf16 rounding
    bad = [t.clone() for t in ref]
    bad[0][5, 3] += 1.0  # a wrong dS entry: small next to the large dB, still caught
    assert tune_kernels.differs(bad, ref)
    assert tune_kernels.differs(ref[:2], ref)  # a missing slot


def test_model_step_settings_parse_and_apply(monkeypatch):
    s = bench_model_step.parse_settings(["tuned:LORAFUSION_TUNING_FILE=t.json",
                                         "both:LORAFUSION_MAIN_GEMM=cublas_fold,LORAFUSION_TUNING_FILE=u.json"])
    assert s == {"": {}, "+tuned": {"LORAFUSION_TUNING_FILE": "t.json"},
                 "+both": {"LORAFUSION_MAIN_GEMM": "cublas_fold", "LORAFUSION_TUNING_FILE": "u.json"}}
    keys = {"LORAFUSION_MAIN_GEMM", "LORAFUSION_TUNING_FILE"}
    monkeypatch.setenv("LORAFUSION_MAIN_GEMM", "triton")
    # restored (unset) after the test whatever happens
    monkeypatch.setenv("LORAFUSION_TUNING_FILE", "old.json")
    bench_model_step.apply_env(s["+tuned"], keys)
    import os

    assert os.environ["LORAFUSION_TUNING_FILE"] == "t.json" and "LORAFUSION_MAIN_GEMM" not in os.environ
    bench_model_step.apply_env(s[""], keys)
    assert not keys & set(os.environ)
    for bad in ("tuned", "tuned:", ":A=1", "x:=1", "x:A"):
        with pytest.raises(SystemExit, match="--setting"):
            bench_model_step.parse_settings([bad])


def test_model_step_profile_summary_families_and_timeline():
    by = {"nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": 60.0, "flash_bwd_kernel": 10.0,
          "_lora_gemm_kernel": 5.0,
          "_ds_db_kernel": 3.0, "_fwd": 2.0, "Memcpy DtoD (Device -> Device)": 1.0, "weird": 1.0}
    tl = {"wall_ms": 100.0, "busy_ms": 82.0, "idle_ms": 18.0}
    out = bench_model_step.summarise({"four_r16": (dict(by, _da_dx_kernel=4.0), tl), "one_r16": (by, tl)})
    four = out["four_r16"]
    assert four["kernel_ms"] == 86.0 and four["timeline"] == tl
    fam = four["families_ms"]
    assert fam["gemm (cuBLAS)"] == 60.0 and fam["attention (flash)"] == 10.0 and fam["LoRA (Triton)"] == 12.0
    assert fam["copies"] == 1.0 and fam["other"] == 1.0
    assert abs(sum(four["families_frac"].values()) - 1.0) < 1e-9
    assert out["four_minus_one_r16"][0] == ("_da_dx_kernel", 4.0)  # what four adapters add, largest first
    assert list(fam) == sorted(fam, key=lambda f: -fam[f])


def test_shared_timer_takes_the_median_after_warm_up_and_the_record_says_where(tmp_path, monkeypatch, capsys):
    import json

    import _bench

    calls, times = [], iter([0.0, 0.010, 0.0, 0.040, 0.0, 0.020])  # host clock: 10, 40, 20 ms (mean 23.3)
    monkeypatch.setattr(_bench.time, "perf_counter", lambda: next(times))
    monkeypatch.setattr(_bench, "_cuda", lambda: False)
    assert _bench.median_ms(lambda: calls.append(1), warmup=2, iters=3) == pytest.approx(20.0)
    assert len(calls) == 5  # the warm-up calls ran and were not timed
    with pytest.raises(ValueError, match="iters"):
        _bench.median_ms(lambda: None, iters=0)
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    monkeypatch.setenv("BENCH_COMMAND", "bash scripts/device/x.sh")
    info = _bench.run_info()
    assert (info["device"], info["commit"], info["command"]) == ("cpu", "abc1234", "bash scripts/device/x.sh")
    _bench.write_json({**info, "tokens_per_s": 1.5}, tmp_path / "sub" / "r.json")
    assert json.loads((tmp_path / "sub" / "r.json").read_text())["tokens_per_s"] == 1.5
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["commit"] == "abc1234"  # the record is the output's last line
