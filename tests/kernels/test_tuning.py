"""kernels/tuning.py reads its environment variables when asked, not at import."""

import json

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
