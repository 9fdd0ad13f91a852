"""DataBatcher: pack samples into microbatches of at most ``capacity`` tokens.

Objective, lexicographic (:func:`pack_objective`, smaller is better):
  1. the number of microbatches (bins);
  2. the imbalance between them, in one of two senses (``balance``):
     * ``"fill"``: the least-loaded bin is the *tail* (MergePass may fill it from a neighbouring
       group); every other bin as full as possible: maximise the minimum load ``L`` over the non-tail
       bins, so all non-tail loads lie in ``[L, capacity]`` (little unused capacity);
     * ``"even"``: all bins as equal as possible: minimise the maximum load (what a 1F1B pipeline
       wants — its bubble grows like 1 − mean/max of the microbatch times — at the price of unused
       capacity when a group packs into few bins).

Algorithm: greedy (first-fit-decreasing (FFD) plus a short local search towards the objective) gives
a plan, a warm start and the fallback. If FFD's bin count exceeds the Martello–Toth L2 lower bound a
MILP minimises the count; a second MILP with the count fixed optimises the balance. Both go through
PuLP (HiGHS when ``highspy`` is importable, else the bundled CBC, run with a hard wall-clock kill),
share one time limit and a relative optimality ``gap`` (the balance MILP is skipped when greedy is
already within it of its bound), and a solution is only taken when it is strictly better than greedy, so the
result is never worse than greedy and the time-limit path returns exactly the greedy plan. Instances
with more than ``max_vars`` assignment variables are improved on a neighbourhood: the MILP re-packs the
items of a few bins (the least loaded for "fill", the most and least loaded for "even"), repeatedly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .milp import MIN_SOLVE_S, milp_even, milp_fill, milp_min_bins
from .spec import PlanError



@dataclass(frozen=True)
class PackResult:
    """``bins[b]`` are indices into the input lengths; bins sorted by load, fullest first (tail last)."""

    bins: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    source: str  # "greedy" or "milp" (the MILP strictly improved on greedy)
    count_optimal: bool  # the bin count equals the L2 lower bound, hence is minimal
    lower_bound: int
    solve_s: float = 0.0
    timed_out: bool = False

    @property
    def num_bins(self) -> int:
        return len(self.bins)

    balance: str = "fill"

    @property
    def objective(self) -> tuple[int, int]:
        return pack_objective(self.loads, self.balance)


def pack_objective(loads: Sequence[int], balance: str = "fill") -> tuple[int, int]:
    """Smaller is better. fill: ``(bins, -min load over all bins but the least-loaded one)``;
    even: ``(bins, max load)``."""
    if balance == "even":
        return (len(loads), max(loads, default=0))
    if len(loads) <= 1:
        return (len(loads), 0)
    return (len(loads), -sorted(loads)[1])


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy FFD: items by decreasing length (ties by index) into the first bin with room."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def fill_upper_bound(lengths: Sequence[int], capacity: int, num_bins: int) -> int:
    """Upper bound on the min non-tail load with ``num_bins`` non-empty bins: the non-tail bins hold
    at most ``total - smallest item`` tokens, and each at most ``capacity``."""
    if num_bins < 2:
        return capacity
    return min(capacity, (sum(lengths) - min(lengths)) // (num_bins - 1))


def _fill_from_tail(lengths: Sequence[int], capacity: int, bins: list[list[int]], rounds: int) -> None:
    """Local search (in place) raising the least-loaded non-tail bin: move the largest tail item that
    fits into it, else swap one of its items for a larger tail item that fits. Stops when stuck."""
    for _ in range(rounds):
        if len(bins) < 3:
            return
        bins.sort(key=lambda b: -sum(lengths[i] for i in b))
        low, tail = bins[-2], bins[-1]
        room = capacity - sum(lengths[i] for i in low)
        fits = [t for t in tail if lengths[t] <= room]
        if fits and len(tail) > 1:
            t = max(fits, key=lambda i: (lengths[i], -i))
            tail.remove(t)
            low.append(t)
            continue
        best = None
        for a in low:
            for t in tail:
                gain = lengths[t] - lengths[a]
                if 0 < gain <= room and (best is None or gain > best[0]):
                    best = (gain, a, t)
        if best is None:
            return
        _, a, t = best
        low.remove(a)
        tail.remove(t)
        low.append(t)
        tail.append(a)


def _lpt(lengths: Sequence[int], capacity: int, n: int) -> list[list[int]] | None:
    """Longest-processing-time into exactly ``n`` bins (each item to the least-loaded bin); None if an
    item fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(n), key=lambda k: (load[k], k))
        if load[b] + lengths[i] > capacity:
            return None
        bins[b].append(i)
        load[b] += lengths[i]
    return bins


def _even_out(lengths: Sequence[int], capacity: int, bins: list[list[int]], rounds: int) -> None:
    """Local search (in place) lowering the most-loaded bin: move one of its items to the least-loaded
    bin, or swap a pair between the two, whenever that lowers their maximum. Stops when stuck."""
    for _ in range(rounds):
        loads = [sum(lengths[i] for i in b) for b in bins]
        hi = max(range(len(bins)), key=loads.__getitem__)
        lo = min(range(len(bins)), key=loads.__getitem__)
        diff = loads[hi] - loads[lo]
        best = None  # (new max of the pair, item from hi, item from lo or None)
        for a in bins[hi]:
            cands = [(None, lengths[a])] + [(t, lengths[a] - lengths[t]) for t in bins[lo]]
            for t, delta in cands:
                if 0 < delta < diff:
                    new_max = max(loads[hi] - delta, loads[lo] + delta)
                    if best is None or new_max < best[0]:
                        best = (new_max, a, t)
        if best is None:
            return
        _, a, t = best
        bins[hi].remove(a)
        bins[lo].append(a)
        if t is not None:
            bins[lo].remove(t)
            bins[hi].append(t)


def greedy_pack(
    lengths: Sequence[int], capacity: int, rounds: int = 64, balance: str = "fill"
) -> list[list[int]]:
    """The greedy plan: FFD, then a local search for the balance objective (fill:
    :func:`_fill_from_tail`; even: LPT into FFD's bin count when it fits, then :func:`_even_out`).
    Never more bins than FFD."""
    bins = first_fit_decreasing(lengths, capacity)
    if balance == "even":
        bins = _lpt(lengths, capacity, len(bins)) or bins
        _even_out(lengths, capacity, bins, rounds)
    else:
        _fill_from_tail(lengths, capacity, bins, rounds)
    return [b for b in bins if b]


def lower_bound(lengths: Sequence[int], capacity: int) -> int:
    """Martello–Toth L2 lower bound on the number of bins (>= ceil(total / capacity))."""
    if len(lengths) == 0:
        return 0
    w = np.asarray(lengths, dtype=np.int64)
    best = math.ceil(w.sum() / capacity)
    half = capacity / 2
    ks = np.unique(np.concatenate([[0], w[w <= half]]))
    for k in ks:
        j1 = w > capacity - k
        j2 = (w > half) & (w <= capacity - k)
        j3 = (w >= k) & (w <= half)
        spare = int(j2.sum()) * capacity - int(w[j2].sum())
        extra = max(0, math.ceil((int(w[j3].sum()) - spare) / capacity))
        best = max(best, int(j1.sum()) + int(j2.sum()) + extra)
    return best


def _valid(bins: list[list[int]] | None, w: Sequence[int], cap: int) -> bool:
    if not bins:
        return False
    seen = sorted(i for b in bins for i in b)
    return seen == list(range(len(w))) and all(sum(w[i] for i in b) <= cap for b in bins)


def _loads(bins: list[list[int]], w: Sequence[int]) -> list[int]:
    return [sum(w[i] for i in b) for b in bins]


class DataBatcher:
    """Packs one group's samples; see the module docstring for objective and guarantees."""

    def __init__(
        self,
        capacity: int,
        time_limit_s: float = 0.5,
        solver: str = "auto",
        max_vars: int = 3000,
        balance: str = "fill",
        gap: float = 0.01,
    ) -> None:
        if capacity < 1:
            raise PlanError("capacity must be positive")
        if balance not in ("fill", "even"):
            raise PlanError(f"balance must be 'fill' or 'even', got {balance!r}")
        self.balance = balance
        self.capacity = int(capacity)
        self.time_limit_s = float(time_limit_s)
        self.solver = solver
        self.max_vars = int(max_vars)
        if not 0 <= gap < 1:
            raise PlanError("gap must be in [0, 1)")
        self.gap = float(gap)

    def pack(self, lengths: Sequence[int], time_limit_s: float | None = None) -> PackResult:
        """Pack ``lengths`` (each in ``1..capacity``) into bins; never worse than greedy FFD."""
        t0 = time.perf_counter()
        cap = self.capacity
        for i, n in enumerate(lengths):
            if not 0 < n <= cap:
                raise PlanError(f"item {i} has {n} tokens, capacity is {cap}")
        budget = self.time_limit_s if time_limit_s is None else time_limit_s
        greedy = greedy_pack(lengths, cap, balance=self.balance)
        lb = lower_bound(lengths, cap)
        best, source, timed_out = greedy, "greedy", False
        if self.solver != "greedy" and len(greedy) > 1 and budget >= MIN_SOLVE_S:
            cand, timed_out = self._improve(lengths, greedy, lb, t0 + budget)
            if _valid(cand, lengths, cap) and self._obj(cand, lengths) < self._obj(greedy, lengths):
                best, source = cand, "milp"
        else:
            timed_out = self.solver != "greedy" and len(greedy) > 1
        return self._result(best, lengths, source, lb, t0, timed_out)

    def _obj(self, bins: list[list[int]], w: Sequence[int]) -> tuple[int, int]:
        return pack_objective(_loads(bins, w), self.balance)

    def _result(self, bins, w, source, lb, t0, timed_out) -> PackResult:
        bins = sorted((sorted(b) for b in bins), key=lambda b: (-sum(w[i] for i in b), b[0]))
        loads = tuple(sum(w[i] for i in b) for b in bins)
        return PackResult(
            bins=tuple(tuple(b) for b in bins),
            loads=loads,
            source=source,
            count_optimal=len(bins) == lb,
            lower_bound=lb,
            solve_s=time.perf_counter() - t0,
            timed_out=timed_out,
            balance=self.balance,
        )

    def _improve(self, w: Sequence[int], greedy: list[list[int]], lb: int, deadline: float):
        """Exact MILP when the instance has at most ``max_vars`` assignment variables, else a large
        neighbourhood search: re-solve a few bins (see :meth:`_neighbourhood`) until nothing improves."""
        if len(w) * len(greedy) <= self.max_vars:
            return self._region(w, greedy, lb, deadline)
        bins, timed_out = [list(b) for b in greedy], False
        while deadline - time.perf_counter() >= MIN_SOLVE_S:
            chosen, kept = self._neighbourhood(w, bins)
            left = deadline - time.perf_counter()
            region, to = self._region(w, chosen, None, time.perf_counter() + max(left / 2, MIN_SOLVE_S))
            timed_out = timed_out or to
            new = region + kept
            if not self._obj(new, w) < self._obj(bins, w):
                break
            bins = new
        return bins, timed_out

    def _neighbourhood(self, w: Sequence[int], bins: list[list[int]]):
        """fill: the least-loaded bins; even: alternately the most and the least loaded; as many as
        keep the region's MILP under ``max_vars // 4`` variables (at least two)."""
        by_load = sorted(bins, key=lambda b: sum(w[i] for i in b))
        if self.balance == "even":
            order = [by_load[k // 2] if k % 2 else by_load[-1 - k // 2] for k in range(len(by_load))]
        else:
            order = by_load
        k, items = 2, len(order[0]) + len(order[1])
        while k < len(order) and (items + len(order[k])) * (k + 1) <= self.max_vars // 4:
            items += len(order[k])
            k += 1
        return order[:k], order[k:]

    def _region(self, w: Sequence[int], bins: list[list[int]], lb: int | None, deadline: float):
        """Re-pack the items of ``bins`` (a subset of the plan) optimally, within ``deadline``."""
        items = sorted((i for b in bins for i in b), key=lambda i: (-w[i], i))
        sw = [w[i] for i in items]
        pos = {i: p for p, i in enumerate(items)}
        warm = [[pos[i] for i in b] for b in bins]
        lb = lower_bound(sw, self.capacity) if lb is None else lb
        solved, timed_out = self._solve_sub(sw, warm, lb, deadline)
        return [[items[p] for p in b] for b in solved], timed_out

    def _solve_sub(self, sw: list[int], warm: list[list[int]], lb: int, deadline: float):
        cap, timed_out = self.capacity, False
        if len(warm) > lb:
            left = deadline - time.perf_counter()
            if left < MIN_SOLVE_S:
                return warm, True
            fewer, optimal = milp_min_bins(sw, cap, warm, self.solver, time.perf_counter() + left / 2, 0.0)
            timed_out = not optimal
            if _valid(fewer, sw, cap) and len(fewer) < len(warm):
                warm = fewer
        if len(warm) < 2 or self._balanced_enough(sw, warm):
            return warm, timed_out
        if deadline - time.perf_counter() < MIN_SOLVE_S:
            return warm, True
        milp = milp_even if self.balance == "even" else milp_fill
        better, optimal = milp(sw, cap, warm, self.solver, deadline, self.gap)
        timed_out = timed_out or not optimal
        if _valid(better, sw, cap) and self._obj(better, sw) < self._obj(warm, sw):
            warm = better
        return warm, timed_out

    def _balanced_enough(self, sw: list[int], bins: list[list[int]]) -> bool:
        """The balance is within the relative ``gap`` of its bound (``gap=0``: it provably cannot
        improve), so a MILP is not worth its time."""
        loads = _loads(bins, sw)
        if self.balance == "even":
            bound = max(math.ceil(sum(sw) / len(bins)), max(sw))
            return max(loads) <= bound * (1 + self.gap)
        return sorted(loads)[1] >= fill_upper_bound(sw, self.capacity, len(bins)) * (1 - self.gap)
