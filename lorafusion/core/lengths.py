"""Sample-length profiles of the synthetic bench data (numpy only).

The one source of the lognormal character-length profiles that ``scripts/make_bench_data.py`` writes as
datasets and that :mod:`lorafusion.scheduler.trace` draws generated jobs' sample lengths from.
"""

from __future__ import annotations

import math

import numpy as np

# name -> (median characters, sigma of the log)
LENGTH_PROFILES: dict[str, tuple[float, float]] = {
    "short": (300, 0.5), "medium": (800, 0.5), "long": (1600, 0.4), "mixed": (700, 0.9)}
MIN_LEN = 16
MAX_LEN = 4096  # make_bench_data's default --max-len (lengths are clipped to MAX_LEN - 2: bos + eos)


def profile_lengths(profile: str, n: int, rng: np.random.Generator, max_len: int = MAX_LEN) -> np.ndarray:
    """``n`` character lengths of a profile, lognormal, truncated to int, clipped to [16, max_len - 2]."""
    median, sigma = LENGTH_PROFILES[profile]
    return np.clip(rng.lognormal(math.log(median), sigma, n).astype(int), MIN_LEN, max_len - 2)


def bench_data_hint(path) -> str:
    """For a dataset file missing under ``data/bench/`` (the shipped large configs' synthetic data): how to
    make it."""
    from pathlib import Path

    p = Path(path)
    if p.exists() or p.parent.name != "bench" or p.parent.parent.name != "data":
        return ""
    return (" (the benchmark datasets are made, not shipped: "
            f"python scripts/make_bench_data.py --out {p.parent})")
