"""The run's jobs: :class:`JobState` (a job's data, stream, optimizer, counts and status) and the one way a
status changes — the transition methods, each under :data:`TRANSITIONS`, the lock the planning thread takes
when it reads the statuses (``Feed._draw``), so it never sees a change half made. Transitions that must land
between two plans (a job the prepared chunk holds keeps its batches) are applied through ``Feed.update_jobs``
by their caller (online admission and cancel); the shown state (waiting, saving, done, stopped) is derived in
one place, :mod:`lorafusion.rundir.states`.

::

    queued ──admit──▶ running ──begin_cancel──▶ cancelling ──cancel──▶ cancelled
      └──────────────cancel──────────────────────────────────────────▶ cancelled
    running / cancelling ──halt──▶ diverged | early_stopped
    any ended job ──hand_over──▶ (saving) ──mark_written──▶ (done)
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cached_property

from lorafusion.config.schema import JobConfig, RunConfig
from lorafusion.data import JobStream, build_tokenizer, load_job_samples
from lorafusion.data.evalset import split_job_samples
from lorafusion.rundir.states import HALTED, JobStatus, final_state, shown_state

TRANSITIONS = threading.RLock()  # every status change, and the planning thread's reading of the statuses

_FROM = {  # transition -> the statuses it may start from
    "admit": {JobStatus.QUEUED},
    "begin_cancel": {JobStatus.RUNNING},
    "cancel": {JobStatus.QUEUED, JobStatus.CANCELLING},
    "halt": {JobStatus.RUNNING, JobStatus.CANCELLING},
}


@dataclass
class JobState:
    cfg: JobConfig
    samples: list[tuple[list[int], int]]  # sample id -> (token ids, prompt length)
    stream: JobStream
    optimizer: object = None
    steps: int = 0  # optimizer steps taken
    tokens: int = 0
    last_loss: float | None = None  # of the last finite step
    first_loss: float | None = None
    status: JobStatus = JobStatus.RUNNING  # its own status (rundir.states): changed only by the methods below
    nonfinite: int = 0  # non-finite (skipped) steps in a row
    # evaluation (runtime/evaluate.py); status early_stopped: no more batches, no more updates
    eval_samples: list[tuple[list[int], int]] | None = None  # None: the job has no eval set
    last_eval: float | None = None
    best_eval: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0
    # ended, and handed over at a chunk boundary (runtime/admission.py): its final checkpoint and PEFT adapter
    # taken (``written`` once their files are complete; checkpoint/handover.py)
    handed_over: bool = False
    written: bool = False

    @cached_property
    def mean_len(self) -> float:
        """Mean sample length in tokens (the samples never change)."""
        return sum(len(t) for t, _ in self.samples) / max(1, len(self.samples))

    # ------------------------------------------------------------------------------------------ what it is
    @property
    def finished(self) -> bool:
        """Its last step ran."""
        return self.steps >= self.stream.total_steps

    @property
    def halted(self) -> bool:
        """Paused for good (diverged or early-stopped): batches planned before still run, changing nothing."""
        return self.status in HALTED

    @property
    def ended(self) -> bool:
        """Nothing more to train: its last step ran, or it diverged, early-stopped or was cancelled."""
        return self.halted or self.status == JobStatus.CANCELLED or (
            self.status == JobStatus.RUNNING and self.finished)

    @property
    def final_status(self) -> JobStatus:
        """The job's state in the run's summary: done | stopped (not finished) | diverged | early_stopped |
        cancelled | queued."""
        return final_state(self.status, finished=self.finished)

    def shown(self, *, run_stopped: bool = False, in_chunk: bool | None = None) -> JobStatus:
        """The job's state in ``status.json`` (see :func:`lorafusion.rundir.states.shown_state`)."""
        return shown_state(self.status, finished=self.finished, handed_over=self.handed_over,
                           written=self.written, run_stopped=run_stopped, in_chunk=in_chunk)

    # ----------------------------------------------------------------------------------------- transitions
    def _move(self, transition: str, to: JobStatus) -> None:
        with TRANSITIONS:
            if self.status not in _FROM[transition]:
                raise RuntimeError(f"job {self.cfg.name}: cannot {transition} a job that is {self.status}")
            self.status = to

    def queue(self) -> None:
        """A submitted job, waiting for room (before the planner sees it)."""
        with TRANSITIONS:
            self.status = JobStatus.QUEUED

    def admit(self) -> None:
        self._move("admit", JobStatus.RUNNING)

    def begin_cancel(self) -> None:
        """No more batches; it is cancelled once its planned ones ran."""
        self._move("begin_cancel", JobStatus.CANCELLING)

    def cancel(self) -> None:
        self._move("cancel", JobStatus.CANCELLED)

    def halt(self, why: JobStatus) -> None:
        """Pause for good (diverged or early-stopped): no more batches, no more updates."""
        if why not in HALTED:
            raise ValueError(f"halt: {why} is not diverged or early_stopped")
        self._move("halt", why)
        self.optimizer.paused = True

    def restore(self, status: str, nonfinite: int = 0) -> None:
        """As its checkpoint recorded it (a resumed run)."""
        with TRANSITIONS:
            self.status, self.nonfinite = JobStatus(status), nonfinite
        self.optimizer.paused = self.halted

    def hand_over(self) -> None:
        """Ended, and its final checkpoint and adapter taken at a chunk boundary (written in the
        background)."""
        self.handed_over = True

    def mark_written(self) -> None:
        """Its final checkpoint and adapter are complete on disk (called from the writing thread)."""
        self.written = True

    # --------------------------------------------------------------------------------------------- steps
    def record_step(self, st: dict) -> tuple[bool, bool]:
        """Count one optimizer step of the pipeline (``st``: its loss, grad_norm, tokens); (finite, skipped).
        The device skipped the update iff the gradient norm was not finite (a non-finite loss back-propagates
        into the gradients); either one counts towards divergence."""
        self.steps += 1
        self.tokens += st["tokens"]
        finite = math.isfinite(st["loss"]) and math.isfinite(st["grad_norm"])
        self.nonfinite = 0 if finite else self.nonfinite + 1
        if finite:
            self.last_loss = st["loss"]
            if self.first_loss is None:
                self.first_loss = st["loss"]
        return finite, not math.isfinite(st["grad_norm"])

    @property
    def diverging(self) -> bool:
        """Its last ``max_nonfinite_steps`` steps were all non-finite."""
        return self.nonfinite >= self.cfg.max_nonfinite_steps


def job_state(job: JobConfig, tokenizer, seed: int) -> JobState:
    """A job's samples (without its held-out eval share), eval samples and data stream (its optimizer comes
    with its adapter, on the model)."""
    samples, eval_samples = split_job_samples(job, load_job_samples(job, tokenizer).samples, tokenizer, seed)
    stream = JobStream.of(job, len(samples), seed)
    return JobState(job, samples, stream, eval_samples=eval_samples)


def load_jobs(cfg: RunConfig):
    """(tokenizer, {job name: JobState}) — every job's samples and stream. Bad data fails here, before any
    model is built or anything is written. (Config validation keeps ``dataset.max_seq_len`` within the
    token capacity and the loader keeps samples within ``max_seq_len``, so every sample fits.)"""
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model.path)
    return tokenizer, {job.name: job_state(job, tokenizer, cfg.seed) for job in cfg.jobs}
