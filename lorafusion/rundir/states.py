"""The states a job shows (DESIGN.md §4) in ``status.json``, ``summary.json`` and ``lorafusion status``, and
the one place they are derived from what the run knows of a job. Torch-free: the CLI's readers use them too.

A job's own status (``JobState.status`` in the run) is queued, running, cancelling, cancelled, diverged or
early_stopped. What is shown adds what the run derives: ``waiting`` (running, but the chunk now training holds
none of its batches), ``saving`` (ended and handed over: its final checkpoint and adapter being written),
``done`` (its last step ran, and its files are written when it was handed over) and ``stopped`` (the run
stopped before the job finished)."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"  # submitted, waiting for room
    RUNNING = "running"
    WAITING = "waiting"  # shown only: running, but not in the chunk now training
    SAVING = "saving"  # shown only: ended, its final checkpoint and adapter being written
    DONE = "done"  # shown only: its last step ran (and its files are written)
    EARLY_STOPPED = "early_stopped"  # paused for good: its eval loss stopped improving
    CANCELLING = "cancelling"  # no more batches; cancelled once its planned ones ran
    CANCELLED = "cancelled"
    DIVERGED = "diverged"  # paused for good: max_nonfinite_steps non-finite steps in a row
    STOPPED = "stopped"  # shown only: the run stopped before the job finished


# paused for good: planned batches change nothing
HALTED = frozenset({JobStatus.DIVERGED, JobStatus.EARLY_STOPPED})
ENDED = frozenset({JobStatus.DONE, JobStatus.CANCELLED, *HALTED})  # nothing left to do (e.g. to cancel)
LIVE = frozenset(
    {JobStatus.RUNNING, JobStatus.WAITING, JobStatus.CANCELLING, JobStatus.SAVING})  # needs its run


def final_state(status: str, *, finished: bool) -> JobStatus:
    """A job's state in the run's summary: its own status when it ended or never started (queued), else done
    (``finished``: its last step ran) or stopped."""
    if status in (*HALTED, JobStatus.CANCELLED, JobStatus.QUEUED):
        return JobStatus(status)
    return JobStatus.DONE if finished else JobStatus.STOPPED


def shown_state(status: str, *, finished: bool, handed_over: bool, written: bool, run_stopped: bool,
                in_chunk: bool | None) -> JobStatus:
    """A job's state in ``status.json`` while its run goes on. ``finished``: its last step ran; ``in_chunk``:
    whether the chunk now starting holds it (None: not known, e.g. between chunks)."""
    if status != JobStatus.RUNNING:
        return JobStatus(status)
    if written:
        return JobStatus.DONE  # its final checkpoint and adapter are written
    if handed_over:
        return JobStatus.SAVING
    if finished:
        return JobStatus.RUNNING
    if run_stopped:
        return JobStatus.STOPPED
    return JobStatus.WAITING if in_chunk is False else JobStatus.RUNNING
