"""Per-adapter metrics: ``metrics.jsonl`` (one object per optimizer step, one ``eval_loss`` object per
evaluation), tensorboard scalars, live progress."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.layout import RunDir


def _finite_or_none(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def cut_metrics(path: Path, steps: dict[str, int]) -> None:
    """Keep only the rows of ``metrics.jsonl`` at or before each job's resumed step (``steps[job]``; rows
    of jobs not in ``steps`` are kept), so a resumed run never repeats a (job, step) row. Atomic."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash: drop it
            continue
        if row.get("job") in steps and row.get("step", 0) > steps[row["job"]]:
            continue
        kept.append(line)
    write_text_atomic(path, "".join(k + "\n" for k in kept))


class MetricsWriter:
    def __init__(self, output_dir: Path, tensorboard: bool = True):
        self.path = RunDir(output_dir).metrics
        self._f = self.path.open("a", buffering=1)
        self._tb = None
        self._rows = 0  # rows logged by this writer: the x axis of the run-wide scalars
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(RunDir(output_dir).tensorboard))

    def log_step(self, record: dict) -> None:
        """record: {"job", "step", "loss", "tokens", "lr", "grad_norm", "skipped", "tokens_per_s", "max_memory_gib",
        "elapsed_s"}; non-finite numbers are written as null."""
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
        self._rows += 1

    def log_eval(self, record: dict) -> None:
        """record: {"job", "step", "eval_loss", "eval_tokens", "best_eval_loss", "best_step"} (an ``eval_loss``
        row; step rows have ``loss`` instead); tensorboard scalar ``<job>/eval_loss``."""
        self._f.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False) + "\n")
        if self._tb is not None and record.get("eval_loss") is not None and math.isfinite(record["eval_loss"]):
            self._tb.add_scalar(f"{record['job']}/eval_loss", record["eval_loss"], record["step"])

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def max_memory_gib() -> float:
    """Peak memory of this process so far: the GPU's allocator peak on CUDA (a host-side counter, no sync),
    else the peak resident set size."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Progress:
    """Per job step/total and last loss; total tokens/s. On a terminal a rich live table; otherwise (a Slurm
    log, a pipe) one plain line per job every ``log_every`` steps and at its last step."""

    def __init__(self, jobs: dict[str, int], enabled: bool = True, log_every: int = 1, terminal: bool | None = None):
        import sys

        self.enabled = enabled
        self.totals = dict(jobs)
        self.log_every = log_every
        self.t0 = time.perf_counter()
        self.tokens = 0
        self._bar = None
        self.plain = enabled and not (sys.stdout.isatty() if terminal is None else terminal)
        if not enabled or self.plain:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

        self._bar = RichProgress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=False)
        self._tasks = {j: self._bar.add_task(j, total=total, info="") for j, total in jobs.items()}
        self._total = self._bar.add_task("tokens/s", total=None, info="")
        self._bar.start()

    def update(self, job: str, step: int, loss: float | None, tokens: int, lr: float | None = None) -> None:
        self.tokens += tokens
        if not self.enabled:
            return
        if self.plain:
            if step % self.log_every == 0 or step == self.totals.get(job):
                rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
                print(f"{job} step {step}/{self.totals.get(job, '?')}  loss "
                      f"{'-' if loss is None else f'{loss:.4f}'}" + ("" if lr is None else f"  lr {lr:.3g}") +
                      f"  {rate:,.0f} tok/s  {max_memory_gib():.2f} GiB  {time.perf_counter() - self.t0:.0f}s",
                      flush=True)
            return
        self._bar.update(self._tasks[job], completed=step, info="loss -" if loss is None else f"loss {loss:.4f}")
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        self._bar.update(self._total, info=f"{rate:,.0f} tok/s  ({self.tokens:,} tokens)")

    def log(self, line: str) -> None:
        """A message for the console (above the live table when there is one)."""
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
