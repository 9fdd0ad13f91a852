"""Microbatch cost model: ``time ≈ a + b·Σ tokens·(1 + gamma·rank) + c·Σ len²``, fitted from timings.

``a`` is the fixed per-microbatch overhead (kernel launches, p2p setup), ``b`` the per-token cost of
the frozen base model's GEMMs, ``c`` the per-sample quadratic attention cost, ``gamma`` the extra cost
per token per unit of LoRA rank. :func:`fit_cost_model` fits a, b, c (non-negative least squares over
the three features) from measured ``(sample lengths, seconds)`` pairs; :func:`auto_token_capacity`
turns a model into a microbatch token capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .spec import PlanError


@dataclass(frozen=True)
class CostModel:
    """Seconds per microbatch as a function of its sample lengths (forward+backward of the whole model
    when used for capacity, forward of the whole model when given to :mod:`.simulate`)."""

    a: float = 1.0e-3
    b: float = 4.0e-6
    c: float = 2.0e-10
    gamma: float = 1.0e-3

    def microbatch_time(self, lengths: Sequence[int], ranks: Sequence[int] | None = None) -> float:
        """Predicted time of one microbatch whose samples have ``lengths`` (and LoRA ``ranks``)."""
        if len(lengths) == 0:
            return 0.0
        ranks = ranks if ranks is not None else [0] * len(lengths)
        lin = sum(n * (1.0 + self.gamma * r) for n, r in zip(lengths, ranks, strict=True))
        return self.a + self.b * lin + self.c * sum(n * n for n in lengths)


def _features(lengths: Sequence[int]) -> list[float]:
    return [1.0, float(sum(lengths)), float(sum(n * n for n in lengths))]


def fit_cost_model(
    observations: Sequence[tuple[Sequence[int], float]], gamma: float = 0.0
) -> CostModel:
    """Fit ``a, b, c >= 0`` by least squares to ``(lengths of the microbatch's samples, seconds)``.

    Columns are scaled before solving; a coefficient that comes out negative is fixed at 0 and the
    rest re-fitted (a small active-set NNLS, enough for three features). Needs >= 3 observations.
    """
    if len(observations) < 3:
        raise PlanError("fit_cost_model needs at least 3 timed microbatches")
    x = np.array([_features(lens) for lens, _ in observations], dtype=float)
    y = np.array([t for _, t in observations], dtype=float)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    xs = x / scale
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    coef = coef / scale
    return CostModel(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]), gamma=gamma)


def auto_token_capacity(
    model: CostModel,
    max_sample_len: int,
    overhead_frac: float = 0.05,
    max_capacity: int = 32768,
    multiple: int = 512,
) -> int:
    """Smallest capacity (a multiple of ``multiple``, >= the longest sample) whose fixed overhead ``a``
    is at most ``overhead_frac`` of a full microbatch's time: ``a <= f·(a + b·C)``. Capped at
    ``max_capacity`` (the activation-memory limit), but never below ``max_sample_len``."""
    if not 0 < overhead_frac < 1:
        raise PlanError("overhead_frac must be in (0, 1)")
    if model.b <= 0:
        need = max_capacity
    else:
        need = model.a * (1.0 - overhead_frac) / (overhead_frac * model.b)
    cap = min(max(need, 1.0), float(max_capacity))
    cap = max(cap, float(max_sample_len))
    return int(math.ceil(cap / multiple) * multiple)
