"""A job's eval set: its ``eval_dataset`` file, or ``eval_split`` of its training file held out.

The held-out share is ``round(eval_split * rows)`` sample ids drawn by a permutation keyed by (run seed,
job name), so it is the same in every run with that seed and on every rank; those samples are removed from
the training samples (the training stream's sample ids are positions in what is left).
"""

from __future__ import annotations

import random

from lorafusion.config.schema import JobConfig
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.data.dataset import DataError, load_job_samples

Samples = list[tuple[list[int], int]]  # (token ids, prompt length)


def split_eval(num_samples: int, fraction: float, seed: int, job: str) -> tuple[list[int], list[int]]:
    """(training sample ids, held-out sample ids), both ascending and disjoint, covering
    ``range(num_samples)``. DataError when either side would be empty."""
    n_eval = int(round(fraction * num_samples))
    if n_eval < 1:
        raise DataError(f"job {job!r}: eval_split: {fraction} of {num_samples} samples is an empty eval set; "
                        f"raise eval_split or use eval_dataset")
    if n_eval >= num_samples:
        raise DataError(f"job {job!r}: eval_split: {fraction} of {num_samples} samples leaves no training "
                        f"samples; lower eval_split")
    order = list(range(num_samples))
    random.Random(mix_seed(seed, name_key(job), 0xE7A1)).shuffle(order)
    held = sorted(order[:n_eval])
    keep = sorted(order[n_eval:])
    return keep, held


def split_job_samples(job: JobConfig, samples: Samples, tokenizer,
                      seed: int) -> tuple[Samples, Samples | None]:
    """(training samples, eval samples or None without an eval set) of ``job`` whose training file gave
    ``samples``."""
    if job.eval_split is not None:
        keep, held = split_eval(len(samples), job.eval_split, seed, job.name)
        return [samples[i] for i in keep], [samples[i] for i in held]
    if job.eval_dataset is not None:
        return samples, load_job_samples(job, tokenizer, "eval_dataset").samples
    return samples, None
