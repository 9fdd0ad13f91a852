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

import importlib.util
import math
import os
import subprocess
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pulp

from .spec import PlanError

_MIN_SOLVE_S = 0.05  # below this remaining budget the MILP is not even built
_CBC_SLACK_S = 0.03  # solver start/stop overhead kept out of the time limit handed to the solver
_HARD_GRACE_S = 0.05  # CBC is killed this long after its own time limit


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


def highs_available() -> bool:
    return importlib.util.find_spec("highspy") is not None


def _use_highs(kind: str) -> bool:
    if kind == "highs" and not highs_available():
        raise PlanError("solver='highs' needs the highspy package")
    return kind == "highs" or (kind == "auto" and highs_available())


def _cbc() -> pulp.PULP_CBC_CMD:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, warmStart=True, threads=1)


def _run_cbc(prob: pulp.LpProblem, deadline: float, gap: float) -> None:
    """PuLP's bundled CBC with ``-sec`` *and* a hard wall-clock kill: CBC only checks its time limit
    between search phases, so a root-node cut loop can overrun it. Uses PuLP's own MPS/solution I/O."""
    solver = _cbc()
    mps, sol, mst = solver.create_tmp_files(prob.name, "mps", "sol", "mst")
    try:
        if deadline - time.perf_counter() < _MIN_SOLVE_S:
            return
        vs, vnames, cnames, _ = prob.writeMPS(mps, rename=1)
        solver.writesol(mst, prob, vs, vnames, cnames)
        time_limit = deadline - time.perf_counter() - _CBC_SLACK_S
        if time_limit < _MIN_SOLVE_S / 2:
            return
        args = [solver.path, mps]
        if prob.sense == pulp.LpMaximize:
            args.append("-max")
        args += ["-mips", mst, "-sec", f"{time_limit:.3f}", "-ratio", f"{gap:g}", "-threads", "1", "-solve",
                 "-solution", sol]
        try:
            subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           stdin=subprocess.DEVNULL, timeout=time_limit + _HARD_GRACE_S, check=False)
        except subprocess.TimeoutExpired:
            return
        if not os.path.exists(sol):
            return
        status, values, _, _, _, sol_status = solver.readsol_MPS(sol, prob, vs, vnames, cnames)
        prob.assignVarsVals(values)
        prob.assignStatus(status, sol_status)
    finally:
        solver.delete_tmp_files(mps, sol, mst)


def _binary(prob: pulp.LpProblem, name: str) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, 0, 1, cat="Binary")
    return pulp.LpVariable(name, 0, 1, cat="Binary")  # pragma: no cover - PuLP < 3.3


def _continuous(prob: pulp.LpProblem, name: str, lo: float, hi: float) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lo, hi)
    return pulp.LpVariable(name, lo, hi)  # pragma: no cover - PuLP < 3.3


def _solve(prob: pulp.LpProblem, kind: str, deadline: float, gap: float = 0.0) -> int:
    """Solve within what is left until ``deadline`` (model building already counted); return PuLP's
    sol_status (1 optimal, 2 feasible at the time limit, else no solution)."""
    time_limit = deadline - time.perf_counter() - _CBC_SLACK_S
    if time_limit < _MIN_SOLVE_S:
        return 0
    prob.sol_status = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if _use_highs(kind):
                prob.solve(pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap))
            else:
                _run_cbc(prob, deadline, gap)
        except pulp.PulpSolverError:  # e.g. the solver stopped before writing a solution
            return 0
    return int(prob.sol_status)


def _read_bins(x: dict[tuple[int, int], pulp.LpVariable], m: int, n: int) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(n)]
    for i in range(m):
        hit = [b for b in range(n) if (i, b) in x and (x[i, b].varValue or 0.0) > 0.5]
        if len(hit) != 1:
            return None
        bins[hit[0]].append(i)
    return [b for b in bins if b]


class _OutOfTime(Exception):
    """Building a model ran into the deadline (model building is Python and not free)."""


def _check(deadline: float) -> None:
    if time.perf_counter() > deadline - _MIN_SOLVE_S:
        raise _OutOfTime


def _milp_or_none(fn):
    """Decorator: a model builder that runs out of time returns ``(None, False)`` (no solution)."""

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _OutOfTime:
            return None, False

    wrapped.__doc__ = fn.__doc__
    return wrapped


def _assignment(prob: pulp.LpProblem, w: Sequence[int], n: int, sym_bins: int, deadline: float) -> dict:
    """x[i, b] with each item once; items are sorted by decreasing length, so for the first
    ``sym_bins`` (interchangeable) bins ``x[i, b] = 0`` for ``b > i`` breaks symmetry."""
    x = {}
    for i in range(len(w)):
        _check(deadline)
        for b in range(n):
            if b < sym_bins and b > i:
                continue
            x[i, b] = _binary(prob, f"x_{i}_{b}")
    for i in range(len(w)):
        prob += pulp.lpSum(x[i, b] for b in range(n) if (i, b) in x) == 1
    return x


def _canonical(bins: list[list[int]], sym_bins: int) -> list[list[int]]:
    """Order bins so a warm start satisfies the symmetry-breaking rule (tail kept last if present)."""
    head = sorted(bins[:sym_bins], key=min)
    return head + bins[sym_bins:]


@_milp_or_none
def _milp_min_bins(
    w: Sequence[int], cap: int, warm: list[list[int]], kind: str, deadline: float, gap: float = 0.0
):
    n = len(warm)
    prob = pulp.LpProblem("lorafusion_min_bins", pulp.LpMinimize)
    x = _assignment(prob, w, n, n, deadline)
    y = [_binary(prob, f"y_{b}") for b in range(n)]
    prob += pulp.lpSum(y)
    for b in range(n):
        _check(deadline)
        prob += pulp.lpSum(w[i] * x[i, b] for i in range(len(w)) if (i, b) in x) <= cap * y[b]
        if b + 1 < n:
            prob += y[b] >= y[b + 1]
    for b, items in enumerate(_canonical(warm, n)):
        y[b].setInitialValue(1)
        for i in items:
            x[i, b].setInitialValue(1)
    status = _solve(prob, kind, deadline, gap)
    if status not in (1, 2):
        return None, False
    return _read_bins(x, len(w), n), status == 1


@_milp_or_none
def _milp_even(
    w: Sequence[int], cap: int, warm: list[list[int]], kind: str, deadline: float, gap: float = 0.0
):
    n = len(warm)
    warm = _canonical(warm, n)
    prob = pulp.LpProblem("lorafusion_even", pulp.LpMinimize)
    x = _assignment(prob, w, n, n, deadline)
    lmax = _continuous(prob, "lmax", 0, cap)
    prob += lmax
    for b in range(n):
        _check(deadline)
        prob += pulp.lpSum(w[i] * x[i, b] for i in range(len(w)) if (i, b) in x) <= lmax
    for b, items in enumerate(warm):
        for i in items:
            x[i, b].setInitialValue(1)
    lmax.setInitialValue(max(sum(w[i] for i in items) for items in warm))
    status = _solve(prob, kind, deadline, gap)
    if status not in (1, 2):
        return None, False
    return _read_bins(x, len(w), n), status == 1


@_milp_or_none
def _milp_fill(
    w: Sequence[int], cap: int, warm: list[list[int]], kind: str, deadline: float, gap: float = 0.0
):
    n = len(warm)
    tail = min(range(n), key=lambda b: sum(w[i] for i in warm[b]))
    warm = _canonical([warm[b] for b in range(n) if b != tail] + [warm[tail]], n - 1)
    prob = pulp.LpProblem("lorafusion_fill", pulp.LpMaximize)
    x = _assignment(prob, w, n, n - 1, deadline)
    lmin = _continuous(prob, "lmin", 0, cap)
    prob += lmin
    for b in range(n):
        _check(deadline)
        load = pulp.lpSum(w[i] * x[i, b] for i in range(len(w)) if (i, b) in x)
        prob += load <= cap
        if b < n - 1:
            prob += load >= lmin
    for b, items in enumerate(warm):
        for i in items:
            if (i, b) in x:
                x[i, b].setInitialValue(1)
    lmin.setInitialValue(min(sum(w[i] for i in items) for items in warm[:-1]))
    status = _solve(prob, kind, deadline, gap)
    if status not in (1, 2):
        return None, False
    return _read_bins(x, len(w), n), status == 1


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
        if self.solver != "greedy" and len(greedy) > 1 and budget >= _MIN_SOLVE_S:
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
        while deadline - time.perf_counter() >= _MIN_SOLVE_S:
            chosen, kept = self._neighbourhood(w, bins)
            left = deadline - time.perf_counter()
            region, to = self._region(w, chosen, None, time.perf_counter() + max(left / 2, _MIN_SOLVE_S))
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
            if left < _MIN_SOLVE_S:
                return warm, True
            fewer, optimal = _milp_min_bins(sw, cap, warm, self.solver, time.perf_counter() + left / 2, 0.0)
            timed_out = not optimal
            if _valid(fewer, sw, cap) and len(fewer) < len(warm):
                warm = fewer
        if len(warm) < 2 or self._balanced_enough(sw, warm):
            return warm, timed_out
        if deadline - time.perf_counter() < _MIN_SOLVE_S:
            return warm, True
        milp = _milp_even if self.balance == "even" else _milp_fill
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
