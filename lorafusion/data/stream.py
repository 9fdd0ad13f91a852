"""Per-job sample streams: which sample ids form each of a job's global batches.

Order: epoch ``e`` visits the samples in ``numpy.random.default_rng([seed, crc32(job name), e])
.permutation(num_samples)`` — a function of (seed, job name, epoch) only, so a job's order does not depend
on the other jobs, on the process, or on ``PYTHONHASHSEED``.

A global batch never spans epochs: each epoch yields ``num_samples // global_batch_size`` global
batches and **drops the remainder** (the last ``num_samples % global_batch_size`` ids of that epoch's
permutation; a different set each epoch since every epoch is reshuffled). ``global_batch_size`` larger
than the dataset is an error.

The job finishes after ``max_steps`` global batches or ``num_epochs`` epochs, whichever comes first.
"""

from __future__ import annotations

import numpy as np

from lorafusion.core.errors import ConfigError
from lorafusion.core.seeds import name_key

__all__ = ["JobStream", "epoch_permutation"]


def epoch_permutation(seed: int, job_name: str, epoch: int, num_samples: int) -> np.ndarray:
    """The order of sample ids in ``epoch`` of job ``job_name`` (int64 array)."""
    key = name_key(job_name)
    rng = np.random.default_rng([int(seed), key, int(epoch)])
    return rng.permutation(num_samples)


class JobStream:
    """Hands out one job's global batches (lists of sample ids) in a deterministic, resumable order."""

    def __init__(self, job_name: str, num_samples: int, global_batch_size: int, seed: int,
                 max_steps: int | None = None, num_epochs: int | None = None) -> None:
        if num_samples < 1:
            raise ConfigError(f"job {job_name!r}: the dataset has no samples")
        if global_batch_size < 1:
            raise ConfigError(f"job {job_name!r}: global_batch_size: expected an integer >= 1, "
                              f"got {global_batch_size}")
        if global_batch_size > num_samples:
            raise ConfigError(f"job {job_name!r}: global_batch_size: expected at most the number of samples "
                              f"({num_samples}), got {global_batch_size}")
        if max_steps is None and num_epochs is None:
            raise ConfigError(f"job {job_name!r}: expected at least one of max_steps or num_epochs")
        if seed < 0:
            raise ConfigError(f"seed: expected an integer >= 0, got {seed}")
        self.job_name = job_name
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.max_steps = max_steps
        self.num_epochs = num_epochs
        self.steps_per_epoch = self.num_samples // self.global_batch_size
        self.epoch = 0
        self.position = 0  # index into the current epoch's permutation
        self.steps_done = 0  # global batches handed out
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    @classmethod
    def of(cls, job, num_samples: int, seed: int) -> "JobStream":
        """The stream of a job (a ``JobConfig``) of ``num_samples`` training samples; its optimizer's warmup
        must fit in its steps (``max_steps`` alone is checked by the config; ``num_epochs``' steps are known
        here)."""
        stream = cls(job.name, num_samples, job.global_batch_size, seed, max_steps=job.max_steps,
                     num_epochs=job.num_epochs)
        if job.optimizer.warmup_steps > stream.total_steps:
            raise ConfigError(f"job {job.name!r}: optimizer.warmup_steps: expected at most the job's "
                              f"{stream.total_steps} steps (num_epochs x samples / global_batch_size), got "
                              f"{job.optimizer.warmup_steps}: the lr would never reach optimizer.lr")
        return stream

    # ------------------------------------------------------------------ order
    @property
    def total_steps(self) -> int:
        """Number of global batches (optimizer steps) this job will take in total."""
        by_epochs = None if self.num_epochs is None else self.num_epochs * self.steps_per_epoch
        if self.max_steps is None:
            return by_epochs
        return self.max_steps if by_epochs is None else min(self.max_steps, by_epochs)

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.total_steps

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = epoch_permutation(self.seed, self.job_name, epoch, self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def next_global_batch(self) -> list[int] | None:
        """Sample ids of the next global batch, or ``None`` once the job is finished."""
        if self.finished:
            return None
        if self.position + self.global_batch_size > self.num_samples:  # drop the remainder
            self.epoch += 1
            self.position = 0
        perm = self._permutation(self.epoch)
        ids = perm[self.position:self.position + self.global_batch_size].tolist()
        self.position += self.global_batch_size
        self.steps_done += 1
        return ids

    def __iter__(self):
        while (batch := self.next_global_batch()) is not None:
            yield batch

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"job_name": self.job_name, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size, "seed": self.seed,
                "epoch": self.epoch, "position": self.position, "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        """Resume; the stream must describe the same job, dataset size, batch size and seed."""
        for key in ("job_name", "num_samples", "global_batch_size", "seed"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(f"job {self.job_name!r}: cannot resume the data stream: the checkpoint has "
                                  f"{key} = {state.get(key)!r}, this run has {getattr(self, key)!r}")
        epoch, position, steps = int(state["epoch"]), int(state["position"]), int(state["steps_done"])
        if epoch < 0 or steps < 0 or not 0 <= position <= self.num_samples:
            raise ConfigError(f"job {self.job_name!r}: invalid data-stream state {state!r}")
        self.epoch, self.position, self.steps_done = epoch, position, steps

    def __repr__(self) -> str:
        return (f"JobStream({self.job_name!r}, step {self.steps_done}/{self.total_steps}, epoch "
                f"{self.epoch}, position {self.position}/{self.num_samples})")
