"""Training progress for people: one row per job — step/max, loss, eval loss, tokens/s, ETA.

On a terminal a live table (``rich``), redrawn a few times a second in place. Elsewhere (a log file, a Slurm
log, a pipe) plain lines: a job's line at its first step, then at most every ``log_every_s`` seconds (at steps
that are multiples of ``log_every``), and at its last step — a few lines a minute, not one per job per step.
Events (an evaluation, a job handed over, a diverging step) are printed as they happen, above the live
table."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass
class _Row:
    total: int | None
    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    lr: float | None = None
    tokens: int = 0  # this session, after its first update
    steps: int = 0  # this session, after its first update
    # first update this session: rate and ETA are over the steps since (the first step's own time is not
    # known here, so a rate over it would divide its tokens by ~0 s)
    t0: float | None = None
    printed: float = float("-inf")  # plain mode: when its last line was printed

    def rate(self, now: float) -> float | None:
        if not self.steps or self.t0 is None or now <= self.t0:
            return None
        return self.tokens / (now - self.t0)

    def eta(self, now: float) -> float | None:
        if not self.steps or self.total is None or self.t0 is None:
            return None
        return max(0, self.total - self.step) * (now - self.t0) / self.steps


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """``jobs``: name -> max steps. ``terminal``: None = whether stderr is a terminal (lines for people go
    there)."""

    def __init__(self, jobs: dict[str, int], enabled: bool = True, log_every: int = 1,
                 log_every_s: float = 30.0, terminal: bool | None = None, memory=None):
        self.enabled = enabled
        self.rows = {j: _Row(total) for j, total in jobs.items()}
        self.log_every, self.log_every_s = log_every, log_every_s
        self.t0 = time.perf_counter()
        self.tokens = 0
        self._memory = memory  # () -> peak GiB, for the plain lines
        self._live = None
        self.plain = enabled and not (sys.stderr.isatty() if terminal is None else terminal)
        if enabled and not self.plain:
            from rich.live import Live

            from rich.console import Console

            self._live = Live(get_renderable=self._table, refresh_per_second=4, transient=False,
                              console=Console(stderr=True))
            self._live.start()

    @classmethod
    def for_run(cls, logging, jobs: dict[str, int], memory=None) -> "Progress":
        """From a run's ``logging`` section (:class:`lorafusion.config.schema.LoggingConfig`)."""
        return cls(jobs, enabled=logging.progress, log_every=logging.log_every,
                   log_every_s=logging.log_every_s, memory=memory)

    def _row(self, job: str, total: int | None) -> _Row:
        row = self.rows.setdefault(job, _Row(total))  # a job may join the run later
        if total is not None:
            row.total = total
        return row

    def update(self, job: str, step: int, loss: float | None, tokens: int, lr: float | None = None,
               total: int | None = None) -> None:
        now = time.perf_counter()
        self.tokens += tokens
        row = self._row(job, total)
        if row.t0 is None:
            row.t0 = now
        else:
            row.tokens += tokens
            row.steps += 1
        row.step, row.loss, row.lr = step, loss, lr
        if not self.enabled or not self.plain:
            return
        last = step == row.total
        if last or (step % self.log_every == 0 and now - row.printed >= self.log_every_s):
            row.printed = now
            print(self._line(job, row, now), file=sys.stderr, flush=True)

    def eval(self, job: str, loss: float) -> None:
        """A job's latest eval loss (its row shows it)."""
        self._row(job, None).eval_loss = loss

    def _line(self, job: str, row: _Row, now: float) -> str:
        mem = f"  {self._memory():.2f} GiB" if self._memory is not None else ""
        return (f"{job} step {row.step}/{row.total if row.total is not None else '?'}  loss {_num(row.loss)}"
                + (f"  eval {_num(row.eval_loss)}" if row.eval_loss is not None else "")
                + ("" if row.lr is None else f"  lr {row.lr:.3g}")
                + f"  {_rate(row.rate(now))} tok/s  ETA {_duration(row.eta(now))}{mem}  {now - self.t0:.0f}s")

    def _table(self):
        from rich.table import Table

        now = time.perf_counter()
        elapsed = now - self.t0
        table = Table(title=f"lorafusion: {self.tokens / max(1e-9, elapsed):,.0f} tokens/s, {elapsed:.0f}s",
                      title_justify="left", expand=False)
        for name, kw in (("job", {}), ("step", {"justify": "right"}), ("loss", {"justify": "right"}),
                         ("eval loss", {"justify": "right"}), ("tokens/s", {"justify": "right"}),
                         ("ETA", {"justify": "right"})):
            table.add_column(name, **kw)
        for job, row in self.rows.items():
            total = "?" if row.total is None else row.total
            table.add_row(job, f"{row.step}/{total}", _num(row.loss), _num(row.eval_loss),
                          _rate(row.rate(now)),
                          "done" if row.total is not None and row.step >= row.total
                          else _duration(row.eta(now)))
        return table

    def log(self, line: str) -> None:
        """A message for the console (above the live table when there is one)."""
        if self._live is not None:
            self._live.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


__all__ = ["Progress"]
