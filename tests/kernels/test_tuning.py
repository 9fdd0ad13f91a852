"""kernels/tuning.py reads its environment variables when asked, not at import."""

import json

import torch

import pytest

from lorafusion.kernels import tuning


def test_main_gemm_env_set_after_import_takes_effect(monkeypatch):
    monkeypatch.delenv("LORAFUSION_MAIN_GEMM", raising=False)
    assert tuning.default_main_gemm() == "cublas"
    monkeypatch.setenv("LORAFUSION_MAIN_GEMM", "cublas_fold")
    assert tuning.default_main_gemm() == "cublas_fold"
    monkeypatch.setenv("LORAFUSION_MAIN_GEMM", "triton")
    assert tuning.default_main_gemm() == "triton"
    assert not hasattr(tuning, "MAIN_GEMM")  # no value frozen at import


def test_tuning_file_env_set_after_import_takes_effect(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LORAFUSION_TUNING_FILE", raising=False)
    shape = (100, 4096, 4096)  # bucket (128, 4096, 4096): not in TUNED
    assert tuning.get_config("gemm", *shape) == tuning.DEFAULTS["gemm"]
    cfg = dict(BM=64, BN=64, BK=32, GROUP_M=4, num_warps=4, num_stages=2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"kernel": "gemm", "bucket": list(tuning.bucket(*shape)), "config": cfg}]))
    monkeypatch.setenv("LORAFUSION_TUNING_FILE", str(path))
    assert tuning.get_config("gemm", *shape) == cfg
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.get_config("gemm", *shape) == tuning.INTERPRET["gemm"]


def test_main_gemm_from_env_reaches_the_op(monkeypatch):
    """The op asks at each call: an env value set after import is used (an unknown one is named)."""
    import torch

    from lorafusion.core.routing import Routing
    from lorafusion.ops.fused import multi_lora_linear_fused

    x, W = torch.randn(4, 8), torch.randn(6, 8)
    A, B = [torch.randn(2, 8)], [torch.randn(6, 2)]
    routing = Routing(segments=((0, 0, 4),), num_rows=4, row_ids=torch.arange(4))
    monkeypatch.setenv("LORAFUSION_MAIN_GEMM", "bogus")
    with pytest.raises(ValueError, match="main_gemm: expected one of .*'bogus'"):
        multi_lora_linear_fused(x, W, None, A, B, [1.0], [0.0], [1], routing)


def test_tuned_configs_are_per_gpu_architecture(monkeypatch):
    """Hopper (SM90: H100, H200) reads the tuned table; another architecture keeps the defaults."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LORAFUSION_TUNING_FILE", raising=False)
    (kernel, bucket), cfg = next((key, c) for key, c in tuning.TUNED.items() if c != tuning.DEFAULTS[key[0]])
    monkeypatch.setattr(tuning, "_ARCH", ["sm90"])
    assert tuning.get_config(kernel, *bucket) == cfg
    monkeypatch.setattr(tuning, "_ARCH", ["sm80"])
    assert tuning.get_config(kernel, *bucket) == tuning.DEFAULTS[kernel]
    monkeypatch.setattr(tuning, "TUNED_BY_ARCH", dict(tuning.TUNED_BY_ARCH))
    tuning.tuned_table()[(kernel, bucket)] = dict(cfg, num_stages=5)  # what the tuner does on that GPU
    assert tuning.get_config(kernel, *bucket)["num_stages"] == 5
    assert tuning.TUNED[(kernel, bucket)] == cfg


def test_tuner_times_each_candidate_with_its_own_config(monkeypatch):
    """The launchers memoize their configs; the tuner must see every candidate, the current one first, and
    keep the fastest for the later cases."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import tune_kernels as T

    from lorafusion.kernels import fused_multi_lora as K

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "TUNED_BY_ARCH", {"sm90": {}})
    monkeypatch.setattr(tuning, "_ARCH", ["sm90"])
    bucket = tuning.bucket(4096, 48, 4096)
    seen = []

    def run(check=False):
        seen.append(K._config("da_dx", 4096, 48, 4096, 2, 64)["BM"])
        return torch.zeros(1)

    monkeypatch.setattr(T, "timeit", lambda fn: (fn(), 1.0 / seen[-1])[1])  # larger BM: faster
    best, before_ms, rows = T.tune_one("da_dx", bucket, run)
    bms = [c["BM"] for c in [tuning.DEFAULTS["da_dx"], *T.CANDIDATES["da_dx"]]]
    assert seen[1::2] == [bm for i, bm in enumerate(bms) if i == 0 or T.CANDIDATES["da_dx"][i - 1] !=
                          tuning.DEFAULTS["da_dx"]]
    assert before_ms == 1.0 / tuning.DEFAULTS["da_dx"]["BM"] and best[0]["BM"] == max(bms)
    assert K._config("da_dx", 4096, 48, 4096, 2, 64)["BM"] == max(bms)
    K._CONFIGS.clear()
