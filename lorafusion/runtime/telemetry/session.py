"""What one training session reports, in one place: global rank 0 writes ``metrics.jsonl`` (and tensorboard),
the progress lines and ``status.json``; on the other ranks every method only counts. The run's counters for
``summary.json`` (chunks, planning time, no-op microbatches, tokens, bubble ratios) are kept here too."""

from __future__ import annotations

import time
from pathlib import Path

from lorafusion.rundir.layout import RunDir


class Telemetry:
    def __init__(self, cfg, out: Path, jobs: dict, *, is_logger: bool, resume: bool, limits: dict):
        from lorafusion.runtime.telemetry.metrics import MetricsWriter, cut_metrics, max_memory_gib
        from lorafusion.runtime.telemetry.progress import Progress
        from lorafusion.runtime.telemetry.status import StatusWriter

        self.jobs = jobs
        self.metrics = self.progress = self.status = None
        self.t_start = time.perf_counter()
        self.chunks = self.plan_s = self.noops = self.tokens = 0  # this session's
        self.bubbles: list[float] = []
        if not is_logger:
            return
        run = RunDir(out)
        run.root.mkdir(parents=True, exist_ok=True)
        if resume:  # rows after each job's checkpoint are trained again: drop them, never repeat them
            cut_metrics(run.metrics, {n: js.steps for n, js in jobs.items()})
        else:  # a fresh run (the directory held at most a failed run's rows, see check_output_dir)
            run.metrics.unlink(missing_ok=True)
        self.metrics = MetricsWriter(out, cfg.logging.tensorboard, cfg.logging.wandb,
                                     cfg.model_dump(mode="json"), mlflow=cfg.logging.mlflow)
        self.progress = Progress.for_run(cfg.logging, {n: js.stream.total_steps for n, js in jobs.items()},
                                         max_memory_gib)
        self.status = StatusWriter(out, jobs, limits=limits)  # status.json (lorafusion status)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def log(self, line: str) -> None:
        if self.progress is not None:
            self.progress.log(line)

    def chunk_start(self, chunk) -> None:
        """The counts as of the last boundary, and who this chunk trains (the other running jobs wait)."""
        if self.status is not None:
            self.status.write(in_chunk=set(chunk.batches))

    def serving(self) -> None:
        if self.status is not None:
            self.status.write("serving")

    def chunk(self, chunk, bubble: float | None) -> None:
        self.chunks += 1
        self.plan_s += chunk.plan_s
        self.noops += chunk.plan.num_noops
        if bubble is not None:
            self.bubbles.append(bubble)

    def step(self, name: str, js, st: dict, *, finite: bool, skipped: bool, mem_gib: float) -> None:
        """One optimizer step of job ``name`` (counted on ``js`` already): its metrics row and progress."""
        self.tokens += st["tokens"]
        if self.metrics is None:
            return
        elapsed = self.elapsed
        self.metrics.log_step({"job": name, "step": js.steps, "loss": st["loss"], "tokens": st["tokens"],
                               "lr": st["lr"], "grad_norm": st["grad_norm"], "skipped": skipped,
                               "tokens_per_s": round(self.tokens / max(1e-9, elapsed), 1),
                               "max_memory_gib": round(mem_gib, 4), "elapsed_s": round(elapsed, 4)})
        self.progress.update(name, js.steps, js.last_loss, st["tokens"], st["lr"], js.stream.total_steps)
        if not finite:
            self.progress.log(f"job {name}: step {js.steps} not finite (loss {st['loss']}, grad norm "
                              f"{st['grad_norm']}){', update skipped' if skipped else ''}: "
                              f"{js.nonfinite} in a row, paused at {js.cfg.max_nonfinite_steps}")

    @property
    def bubble_ratio(self) -> float | None:
        """The mean of the chunks' bubble ratios (None without pipeline parallelism)."""
        return (sum(self.bubbles) / len(self.bubbles)) if self.bubbles else None

    def end(self, summary: dict) -> None:
        if self.status is not None:
            self.status.write(summary["status"], {n: j["status"] for n, j in summary["jobs"].items()})

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
