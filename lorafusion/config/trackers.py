"""The optional experiment trackers of ``logging``: Weights & Biases and MLflow. Each is an extra, not a
dependency: asking for one that is not installed is one error naming the field, before torch is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


def _require(tracker: BaseModel, package: str, pip_name: str) -> BaseModel:
    """``tracker`` when ``package`` (the extra of the same name, ``logging.<package>``) is importable; else
    the one error the field's validation reports."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ValueError(f"the {package} package is not installed: pip install 'lorafusion[{package}]' (or "
                         f"pip install {pip_name}), or remove logging.{package}")
    return tracker


class _Strict(BaseModel):  # as lorafusion.config.schema's (which imports this module)
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False,
                              allow_inf_nan=False, frozen=True)


class WandbConfig(_Strict):
    """Weights & Biases, an optional tracker (``pip install 'lorafusion[wandb]'``): every job's step and eval
    rows as ``<job>/<metric>``. ``mode: offline`` (the default) writes ``OUTPUT_DIR/wandb/`` and needs no
    network or account (``wandb sync`` uploads it later); ``online`` logs as it trains. ``name``: default the
    run directory's name."""

    project: str = "lorafusion"
    mode: Literal["offline", "online"] = "offline"
    name: str | None = None

    @model_validator(mode="after")
    def _installed(self) -> "WandbConfig":
        return _require(self, "wandb", "wandb")


class MlflowConfig(_Strict):
    """MLflow, an optional tracker (``pip install 'lorafusion[mlflow]'``, the ``mlflow-skinny`` client): one
    MLflow run per training session in ``experiment``, every job's step and eval rows as ``<job>/<metric>`` at
    the job's step, the run config as artifact ``config.json``. ``tracking_uri``: default the local file store
    ``OUTPUT_DIR/mlruns`` (no server or network); or a server (``http://host:5000``) or database
    (``sqlite:///path/mlflow.db``, needs the full ``mlflow``). ``run_name``: default the run directory's
    name."""

    experiment: str = "lorafusion"
    tracking_uri: str | None = None
    run_name: str | None = None

    @model_validator(mode="after")
    def _installed(self) -> "MlflowConfig":
        return _require(self, "mlflow", "mlflow-skinny")
