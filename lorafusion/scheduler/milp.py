"""The MILPs behind :class:`lorafusion.scheduler.batcher.DataBatcher`: minimum bin count, then the
balance objective ("fill" or "even") with the count fixed, through PuLP (HiGHS when ``highspy`` is
importable, else the bundled CBC run with a hard wall-clock kill). Each returns ``None`` when it runs out
of time or finds nothing; the batcher only takes a solution that beats greedy."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence

import pulp

from .spec import PlanError

MIN_SOLVE_S = 0.05  # below this remaining budget the MILP is not even built
_CBC_SLACK_S = 0.03  # solver start/stop overhead kept out of the time limit handed to the solver
_HARD_GRACE_S = 0.05  # CBC is killed this long after its own time limit


def highs_available() -> bool:
    return importlib.util.find_spec("highspy") is not None


def _use_highs(kind: str) -> bool:
    if kind == "highs" and not highs_available():
        raise PlanError("solver='highs' needs the highspy package")
    use = kind == "highs" or (kind == "auto" and highs_available())
    if use:
        _quiet_highs_banner()
    return use


_BANNER_LOCK = threading.Lock()
_BANNER_DONE = False


def _quiet_highs_banner() -> None:
    """HiGHS prints its banner ("Running HiGHS 1.16.0 ...") on the process's stdout in the C++ constructor of
    the first ``Highs()`` of a process, before ``output_flag`` (PuLP's ``msg=False``) can be set; later ones
    are silent. Make that first one here with file descriptor 1 on /dev/null for the constructor's
    duration."""
    global _BANNER_DONE
    with _BANNER_LOCK:
        if _BANNER_DONE:
            return
        _BANNER_DONE = True
        import highspy

        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 1)
                try:
                    highspy.Highs()
                finally:
                    os.dup2(saved, 1)
        finally:
            os.close(saved)


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
        if deadline - time.perf_counter() < MIN_SOLVE_S:
            return
        vs, vnames, cnames, _ = prob.writeMPS(mps, rename=1)
        solver.writesol(mst, prob, vs, vnames, cnames)
        time_limit = deadline - time.perf_counter() - _CBC_SLACK_S
        if time_limit < MIN_SOLVE_S / 2:
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
    if time_limit < MIN_SOLVE_S:
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
    if time.perf_counter() > deadline - MIN_SOLVE_S:
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
def milp_min_bins(
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
def milp_even(
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
def milp_fill(
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
