"""Per-adapter metrics: ``metrics.jsonl`` (one object per optimizer step), tensorboard scalars, live progress."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


class MetricsWriter:
    def __init__(self, output_dir: Path, tensorboard: bool = True):
        self.path = Path(output_dir) / "metrics.jsonl"
        self._f = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def log_step(self, record: dict) -> None:
        """record: {"job", "step", "loss", "tokens", "lr", "grad_norm", "elapsed_s"}."""
        # strict JSON: a non-finite number is written as null, never as a bare NaN/Infinity
        self._f.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False) + "\n")
        if self._tb is not None:
            job, step = record["job"], record["step"]
            for key in ("loss", "lr", "grad_norm", "tokens"):
                self._tb.add_scalar(f"{job}/{key}", record[key], step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A rich live table: per job step/total and last loss; total tokens/s."""

    def __init__(self, jobs: dict[str, int], enabled: bool = True):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.tokens = 0
        self._bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

        self._bar = RichProgress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=False)
        self._tasks = {j: self._bar.add_task(j, total=total, info="") for j, total in jobs.items()}
        self._total = self._bar.add_task("tokens/s", total=None, info="")
        self._bar.start()

    def update(self, job: str, step: int, loss: float | None, tokens: int) -> None:
        self.tokens += tokens
        if not self.enabled:
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
