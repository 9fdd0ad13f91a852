"""logging.wandb: an optional tracker (the `wandb` extra). Without the package: one clear error naming the
field, before anything is written. With it: offline mode, no network, every job's rows logged."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wandb_not_installed_is_one_clear_error(monkeypatch, tmp_path):
    import importlib.util

    from lorafusion.config import ConfigError, load_run_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb: the wandb package is not installed: pip install "
                                          r"'lorafusion\[wandb\]'.* \(set by override "
                                          r"'logging.wandb=true'\)"):
        load_run_config(ROOT / "configs" / "quickstart.yaml",
                        ["logging.wandb=true", f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_wandb_offline_logs_every_job(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(sys.path), "HOME": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "lorafusion.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
         f"output_dir={out}", "logging.wandb.project=lf-test", "logging.progress=false",
         "jobs.shout.eval_split=0.1", "jobs.shout.eval_every=2",
         *[f"jobs.{i}.max_steps=2" for i in range(3)],
         *[f"jobs.{i}.optimizer.warmup_steps=2" for i in range(3)]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    for key in (b"successor/loss", b"shout/loss", b"countdown/loss", b"shout/eval_loss", b"lf-test"):
        assert key in data, key
