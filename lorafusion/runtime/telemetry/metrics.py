"""Per-adapter metrics: ``metrics.jsonl`` (one object per optimizer step, one ``eval_loss`` object per
evaluation), tensorboard scalars, W&B and MLflow when asked (the live view: :mod:`.progress`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.layout import RunDir
from lorafusion.runtime.telemetry.progress import Progress  # noqa: F401  (the trainer's one import)


def _finite_or_none(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def cut_metrics(path: Path, steps: dict[str, int]) -> None:
    """Keep only the rows of ``metrics.jsonl`` at or before each job's resumed step (``steps[job]``; rows
    of jobs not in ``steps`` are kept), so a resumed run never repeats a (job, step) row. Atomic."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            row = json.loads(line)
        except (UnicodeDecodeError, ValueError, RecursionError):
            # a line cut short by a crash, damage: dropped
            continue
        if not isinstance(row, dict):  # (no row of ours)
            continue
        step = row.get("step", 0)
        if row.get("job") in steps and (not isinstance(step, int) or step > steps[row["job"]]):
            continue
        kept.append(line)
    write_text_atomic(path, "".join(k + "\n" for k in kept))


class MetricsWriter:
    """Every step and eval row into ``metrics.jsonl``, and into the trackers the run asks for: tensorboard,
    and Weights & Biases (``wandb``: a :class:`lorafusion.config.schema.WandbConfig`, offline unless it says
    online) and MLflow (``mlflow``: a :class:`lorafusion.config.schema.MlflowConfig`, a file store in the run
    unless it says)."""

    def __init__(self, output_dir: Path, tensorboard: bool = True, wandb=None, config: dict | None = None,
                 mlflow=None):
        self.path = RunDir(output_dir).metrics
        if self.path.exists() and not self.path.is_file():  # (a FIFO would block the run's start for good)
            from lorafusion.core.errors import MissingFileError

            raise MissingFileError(
                f"{self.path}: not a regular file; expected the run's metrics (JSON lines)")
        self._f = self.path.open("a", buffering=1)
        self._tb = self._wandb = self._mlflow = None
        self._rows = 0  # rows logged by this writer: the x axis of the run-wide scalars
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(RunDir(output_dir).tensorboard))
        if wandb is not None:
            import wandb as wb

            self._wandb = wb.init(project=wandb.project, mode=wandb.mode,
                                  name=wandb.name or Path(output_dir).name,
                                  dir=str(output_dir), config=config, reinit="finish_previous")
        if mlflow is not None:
            from lorafusion.runtime.telemetry.mlflow_tracker import MlflowTracker

            self._mlflow = MlflowTracker(mlflow, output_dir, config)

    def _to_trackers(self, record: dict, keys: tuple[str, ...]) -> None:
        if self._wandb is not None:
            job = record["job"]
            self._wandb.log({f"{job}/{k}": record[k] for k in (*keys, "step") if record.get(k) is not None})
        if self._mlflow is not None:
            self._mlflow.log(record, keys)

    def log_step(self, record: dict) -> None:
        """record: {"job", "step", "loss", "tokens", "lr", "grad_norm", "skipped", "tokens_per_s",
        "max_memory_gib", "elapsed_s"}; non-finite numbers are written as null."""
        # strict JSON: a non-finite number is written as null, never as a bare NaN/Infinity
        self._f.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False) + "\n")
        if self._tb is not None:
            job, step = record["job"], record["step"]
            for key in ("loss", "lr", "grad_norm", "tokens"):
                if record.get(key) is not None:
                    self._tb.add_scalar(f"{job}/{key}", record[key], step)
            for key in ("tokens_per_s", "max_memory_gib"):  # run-wide: one point per logged row
                if record.get(key) is not None:
                    self._tb.add_scalar(f"run/{key}", record[key], self._rows)
        self._to_trackers({k: _finite_or_none(v) for k, v in record.items()},
                          ("loss", "lr", "grad_norm", "tokens"))
        self._rows += 1

    def log_eval(self, record: dict) -> None:
        """record: {"job", "step", "eval_loss", "eval_tokens", "best_eval_loss", "best_step"} (an
        ``eval_loss`` row; step rows have ``loss`` instead); tensorboard scalar ``<job>/eval_loss``."""
        self._f.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False) + "\n")
        if (self._tb is not None and record.get("eval_loss") is not None
                and math.isfinite(record["eval_loss"])):
            self._tb.add_scalar(f"{record['job']}/eval_loss", record["eval_loss"], record["step"])
        self._to_trackers({k: _finite_or_none(v) for k, v in record.items()}, ("eval_loss", "best_eval_loss"))

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()


def max_memory_gib() -> float:
    """Peak memory of this process so far: the GPU's allocator peak on CUDA (a host-side counter, no sync),
    else the peak resident set size."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
