"""logging.mlflow: an optional tracker (the `mlflow` extra). Without the package: one clear error naming the
field, before anything is written. With it: a local file store in the run directory (no server, no network),
every job's step and eval rows as `<job>/<metric>` at the job's step, the run FINISHED (FAILED when the run
fails)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mlflow_not_installed_is_one_clear_error(monkeypatch, tmp_path):
    import importlib.util

    from lorafusion.config import ConfigError, load_run_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.mlflow: the mlflow package is not installed: pip install "
                                          r"'lorafusion\[mlflow\]'.* \(set by override "
                                          r"'logging.mlflow=true'\)"):
        load_run_config(ROOT / "configs" / "quickstart.yaml",
                        ["logging.mlflow=true", f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()


def _runs(store: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.resolve().as_uri())
    exp = client.get_experiment_by_name("lorafusion")
    return client, client.search_runs([exp.experiment_id])


def test_metrics_writer_logs_each_job_to_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lorafusion.config.trackers import MlflowConfig
    from lorafusion.runtime.telemetry.metrics import MetricsWriter

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    w = MetricsWriter(tmp_path, tensorboard=False, config={"jobs": [{"name": "a"}, {"name": "b"}]},
                      mlflow=MlflowConfig())
    for step in (1, 2):
        w.log_step(
            {"job": "a", "step": step, "loss": 3.0 / step, "tokens": 10, "lr": 1e-3,
             "grad_norm": float("nan"), "skipped": False})
    w.log_step(
        {"job": "b", "step": 1, "loss": 5.0, "tokens": 7, "lr": 1e-3, "grad_norm": 1.0, "skipped": False})
    w.log_eval(
        {"job": "b", "step": 1, "eval_loss": 4.5, "eval_tokens": 3, "best_eval_loss": 4.5, "best_step": 1})
    w.close()
    client, (run,) = _runs(tmp_path / "mlruns")
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.tags["lorafusion.jobs"] == "a,b"
    hist = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
            for k in ("a/loss", "b/loss", "b/eval_loss", "a/grad_norm")}
    assert hist == {"a/loss": [(1, 3.0), (2, 1.5)], "b/loss": [(1, 5.0)], "b/eval_loss": [(1, 4.5)],
                    "a/grad_norm": []}  # a non-finite number is not logged


def test_mlflow_run_failed_when_closed_during_an_error(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lorafusion.config.trackers import MlflowConfig
    from lorafusion.runtime.telemetry.metrics import MetricsWriter

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    w = MetricsWriter(tmp_path, tensorboard=False, mlflow=MlflowConfig(run_name="r"))
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("boom")
        finally:
            w.close()
    _, (run,) = _runs(tmp_path / "mlruns")
    assert run.info.status == "FAILED" and run.info.run_name == "r"


@pytest.mark.slow
def test_mlflow_train_logs_every_job(tmp_path):
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "HOME": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "lorafusion.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
         f"output_dir={out}", "logging.mlflow=true", "logging.progress=false",
         "jobs.shout.eval_split=0.1", "jobs.shout.eval_every=2",
         *[f"jobs.{i}.max_steps=2" for i in range(3)],
         *[f"jobs.{i}.optimizer.warmup_steps=2" for i in range(3)]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warn" not in (res.stdout + res.stderr).lower()  # no tracker banner or warning on a normal run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    _, (run,) = _runs(out / "mlruns")
    assert run.info.status == "FINISHED"
    assert {"successor/loss", "shout/loss", "countdown/loss", "shout/eval_loss"} <= set(run.data.metrics)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r["loss"] for r in rows if r["job"] == "countdown" and r["step"] == 2 and "loss" in r]
    assert run.data.metrics["countdown/loss"] == pytest.approx(last[0])  # the latest value, as metrics.jsonl
