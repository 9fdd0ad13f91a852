"""MLflow, an optional tracker (``logging.mlflow``; ``pip install 'lorafusion[mlflow]'``): one MLflow run per
training session, every job's step and eval rows as metrics ``<job>/<metric>`` at the job's step, the run
config as the artifact ``config.json``. By default a local file store ``OUTPUT_DIR/mlruns`` (no server, no
network)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def tracking_uri(cfg, output_dir: Path) -> str:
    """``cfg.tracking_uri`` as given, else the file store ``OUTPUT_DIR/mlruns`` (MLflow 3 refuses a file store
    unless ``MLFLOW_ALLOW_FILE_STORE`` is set: it is set here for that default, never for a URI the user
    gave)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (Path(output_dir).resolve() / "mlruns").as_uri()


class MlflowTracker:
    def __init__(self, cfg, output_dir: Path, config: dict | None):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri(cfg, output_dir))
        exp = self._client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(cfg.experiment)
        jobs = [j.get("name") for j in (config or {}).get("jobs", []) if isinstance(j, dict)]
        tags = {"lorafusion.output_dir": str(Path(output_dir).resolve()),
                "lorafusion.jobs": ",".join(map(str, jobs))}
        self._run = self._client.create_run(exp_id, run_name=cfg.run_name or Path(output_dir).name, tags=tags)
        if config is not None:
            self._client.log_dict(self._run.info.run_id, config, "config.json")

    def log(self, record: dict, keys: tuple[str, ...]) -> None:
        """``record``'s ``keys`` (numbers only) as ``<job>/<key>`` at the job's step."""
        from mlflow.entities import Metric

        now, job, step = int(time.time() * 1000), record["job"], int(record["step"])
        metrics = [Metric(f"{job}/{k}", float(record[k]), now, step) for k in keys
                   if isinstance(record.get(k), int | float) and not isinstance(record.get(k), bool)]
        if metrics:
            self._client.log_batch(self._run.info.run_id, metrics=metrics)

    def close(self) -> None:
        """The MLflow run ends FINISHED, or FAILED when called while an error propagates (the trainer's
        finally)."""
        failed = sys.exc_info()[0] is not None
        self._client.set_terminated(self._run.info.run_id, status="FAILED" if failed else "FINISHED")
