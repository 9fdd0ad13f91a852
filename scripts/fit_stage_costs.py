"""Fit the pipeline stage cost model (lorafusion/scheduler/stagecost.py) to the per-rank busy time of the
pipeline runs under docs/results/ (CPU only, no GPU).

Every record with ``bubble_ratio_per_rank`` and pp > 1 is a run; a rank's busy time is
``(1 - bubble_r) x timed_s`` (the stage timers' forward + backward compute over the timed chunks), averaged
over the TP / DP ranks of one pipeline stage. Each run's split, recompute per rank and base precision come
from the record (its memory plan, its ``parallelism``, its overrides) and otherwise from its config at its
commit (``git show``). The model (``stagecost.rank_work``) predicts a rank's work in bf16-layer units; busy =
scale x work, with one time scale per group of runs measured on one machine kind at one commit and one
token capacity and layout (the bf16 and FP8 70B runs on 4x H100 share one, which is what ties the FP8
layer's cost to the bf16 layer's). Least squares (Levenberg-Marquardt, the scales solved in closed form) on
the busy time relative to each run's mean rank: the shares, plus the FP8/bf16 ratio through the shared scale.

Runs of EXCLUDED models are not fitted but printed as a check (their ranks' busy time is set by the host
launching kernels, not by their layers' work).

    python scripts/fit_stage_costs.py            # print the fit, residuals, leave-one-run-out
    python scripts/fit_stage_costs.py --write    # also write lorafusion/scheduler/stage_costs.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafusion.core.arch import preset  # noqa: E402
from lorafusion.core.precision import FP8_BF16_LEADING_LAYERS  # noqa: E402
from lorafusion.scheduler.stagecost import STAGE_COSTS_FILE, StageCosts, rank_work  # noqa: E402
from lorafusion.scheduler.stages import flop_loss_layers  # noqa: E402

RESULTS = ROOT / "docs" / "results"
COMMAND = "python scripts/fit_stage_costs.py --write"
# models whose pipeline ranks wait on the host (kernel launches: scheduler/virtual.py's OP_S), not on work
EXCLUDED = {"llama3.1-8b": "host-bound at this size: per-rank busy time does not follow the layers' work"}
START = {"recompute": 0.42, "first_rank": 0.0, "fp8_layer": 1.0, "loss": 2.0}  # the constants before


@dataclass(frozen=True)
class Run:
    name: str  # file + the record's path inside it
    model: str
    precision: str
    pp: int
    split: tuple[int, ...]  # decoder layers per virtual stage (layer order)
    recompute: tuple[int, ...]  # per pipeline rank
    busy: tuple[float, ...]  # seconds per pipeline rank
    group: str  # runs of one group share one time scale
    record: dict = field(default_factory=dict, compare=False, repr=False)  # the record as read

    @property
    def shares(self) -> np.ndarray:
        b = np.array(self.busy)
        return b / b.mean()


def _config_at(commit: str | None, path: str) -> dict:
    """The run config as committed at ``commit`` (the working tree's where git does not have it)."""
    if commit:
        got = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode == 0:
            return yaml.safe_load(got.stdout)
    return yaml.safe_load((ROOT / path).read_text())


def _records(obj, name: str, inherited: dict):
    """(path, fields) of every record under ``obj`` with per-rank bubbles, inheriting its parents' fields."""
    if isinstance(obj, dict):
        here = {**inherited, **{k: v for k, v in obj.items() if not isinstance(v, dict | list) or k in (
            "parallelism", "overrides", "memory_plan", "bubble_ratio_per_rank")}}
        if obj.get("bubble_ratio_per_rank"):
            yield name, here
        for k, v in obj.items():
            if isinstance(v, dict) and k not in ("parallelism", "memory_plan"):
                yield from _records(v, f"{name}.{k}", here)


def _override(rec: dict, key: str):
    for o in rec.get("overrides") or []:
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    return None


def _run(name: str, rec: dict) -> Run | None:
    par = rec.get("parallelism") or {}
    pp, tp, dp, v = (int(par.get(k) or 1) for k in ("pp", "tp", "dp", "virtual_stages"))
    if pp < 2 or "config" not in rec or "timed_s" not in rec:
        return None
    cfg = _config_at(rec.get("commit"), rec["config"])
    model = cfg["model"]["preset"]
    layers = preset(model).num_layers
    plan = rec.get("memory_plan") or {}
    split = next((s for s in (par.get("stage_layers"), plan.get("stage_layers")) if isinstance(s, list)),
                 [layers // (pp * v)] * (pp * v))
    per_rank = [sum(split[k::pp]) for k in range(pp)]
    rc = plan.get("recompute_layers")
    if rc is None:
        on = _override(rec, "model.recompute") or str(cfg["model"].get("recompute", False))
        n = _override(rec, "model.recompute_layers") or cfg["model"].get("recompute_layers")
        rc = [0 if on.lower() == "false" else min(int(n), k) if n is not None else k for k in per_rank]
    precision = _override(rec, "model.base_precision") or cfg["model"].get("base_precision", "bf16")
    b = rec["bubble_ratio_per_rank"]
    per = tp * dp  # Megatron's rank order: the pipeline stage is the slowest-varying index
    busy = [rec["timed_s"] * (1 - float(np.mean(b[s * per:(s + 1) * per]))) for s in range(pp)]
    group = f"{rec.get('device')}|{rec.get('commit')}|{plan.get('token_capacity')}|tp{tp} pp{pp} v{v} dp{dp}"
    return Run(name, model, precision, pp, tuple(split), tuple(int(x) for x in rc), tuple(busy), group, rec)


def load_runs(results: Path = RESULTS) -> list[Run]:
    """Every pipeline run with per-rank bubbles under ``results``, in file order."""
    out = []
    for path in sorted(results.glob("*.json")):
        for name, rec in _records(json.loads(path.read_text()), path.name, {}):
            run = _run(name, rec)
            if run is not None:
                out.append(run)
    return out


def costs_of(theta: np.ndarray, models: list[str]) -> StageCosts:
    """The StageCosts of a parameter vector: recompute, first_rank, fp8_layer, then a loss factor per
    model (the default factor: the first model's, the one with the most records)."""
    by = {m: float(x) for m, x in zip(models, theta[3:], strict=True)}
    return StageCosts(recompute=float(theta[0]), first_rank=float(theta[1]), fp8_layer=float(theta[2]),
                      loss_flop_factor=by[models[0]], loss_flop_factor_by_preset=by)


def work(run: Run, costs: StageCosts) -> np.ndarray:
    arch = preset(run.model)
    lead = FP8_BF16_LEADING_LAYERS if run.precision == "fp8" else None
    loss = costs.loss_factor(arch) * flop_loss_layers(arch)
    return np.array(rank_work(run.split, run.pp, run.recompute, loss, costs, lead))


def residuals(runs: list[Run], costs: StageCosts, shared: bool = True) -> dict[str, np.ndarray]:
    """Per run: (busy - scale x work) / the run's mean busy, each group's scale by least squares
    (``shared=False``: one scale per run, i.e. the busy shares alone)."""
    out = {}
    for g in dict.fromkeys(r.group if shared else r.name for r in runs):
        mine = [r for r in runs if (r.group if shared else r.name) == g]
        ys = [np.array(r.busy) / np.mean(r.busy) for r in mine]
        ws = [work(r, costs) / np.mean(r.busy) for r in mine]
        scale = sum(y @ w for y, w in zip(ys, ws, strict=True)) / sum(w @ w for w in ws)
        out.update({r.name: y - scale * w for r, y, w in zip(mine, ys, ws, strict=True)})
    return out


def _jacobian(res, x: np.ndarray, r: np.ndarray) -> np.ndarray:
    jac = np.empty((len(r), len(x)))
    for i in range(len(x)):
        d = np.zeros_like(x)
        d[i] = 1e-6
        jac[:, i] = (res(x + d) - r) / 1e-6
    return jac


def fit(runs: list[Run], models: list[str], iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """(coefficients, their standard errors) by Levenberg-Marquardt from the constants the planner had before
    (a parameter no run informs, such as the FP8 layer's cost without an FP8 run, stays at its start; its
    error is reported as inf). The errors: residual variance over the degrees of freedom left after the
    coefficients and the time scales, times the diagonal of (J^T J)^-1."""
    def res(t):
        return np.concatenate(list(residuals(runs, costs_of(t, models)).values()))

    x = np.array([START["recompute"], START["first_rank"], START["fp8_layer"]]
                 + [START["loss"]] * len(models))
    damp, r = 1e-3, res(x)
    for _ in range(iters):
        jac = _jacobian(res, x, r)
        a = jac.T @ jac
        step = np.linalg.solve(a + damp * np.diag(np.diag(a) + 1e-9), -jac.T @ r)
        r_new = res(x + step)
        if r_new @ r_new < r @ r:
            x, r, damp = x + step, r_new, damp / 3
        else:
            damp *= 4
        if np.abs(step).max() < 1e-9:
            break
    jac = _jacobian(res, x, r)
    dof = max(1, len(r) - len(x) - len({g.group for g in runs}))
    a = jac.T @ jac
    known = np.diag(a) > 1e-12
    se = np.full(len(x), np.inf)
    se[known] = np.sqrt(np.diag(np.linalg.pinv(a[np.ix_(known, known)])) * (r @ r) / dof)
    return x, se


def _rms(res: dict[str, np.ndarray]) -> float:
    allr = np.concatenate(list(res.values())) if res else np.zeros(1)
    return float(np.sqrt(np.mean(allr ** 2)))


def leave_one_out(runs: list[Run], models: list[str]) -> dict[str, dict]:
    """Per run: fitted on the others, its predicted per-rank busy shares against the measured ones."""
    out = {}
    for held in runs:
        rest = [r for r in runs if r is not held]
        ms = [m for m in models if any(r.model == m for r in rest)]
        costs = costs_of(fit(rest, ms)[0], ms)
        pred = work(held, costs)
        note = "" if any(r.precision == held.precision for r in rest) else \
            f" ({held.precision}: no other run, fp8_layer held at {START['fp8_layer']})"
        out[held.name] = {"measured": held.shares.round(4).tolist(),
                          "predicted": (pred / pred.mean()).round(4).tolist(),
                          "error": (pred / pred.mean() - held.shares).round(4).tolist(), "note": note}
    return out


def report(runs: list[Run], checks: list[Run], theta: np.ndarray, se: np.ndarray, models: list[str]) -> dict:
    costs = costs_of(theta, models)
    names = ["recompute", "first_rank", "fp8_layer"] + [f"loss_flop_factor {m}" for m in models]
    before = StageCosts(loss_flop_factor=START["loss"])
    res, res0 = residuals(runs, costs), residuals(runs, before)
    sh, sh0 = residuals(runs, costs, shared=False), residuals(runs, before, shared=False)
    loo = leave_one_out(runs, models)
    coeffs = {"recompute": round(costs.recompute, 4), "first_rank": round(costs.first_rank, 4),
              "fp8_layer": round(costs.fp8_layer, 4), "loss_flop_factor": round(costs.loss_flop_factor, 4),
              "loss_flop_factor_by_preset": {m: round(v, 4)
                                             for m, v in costs.loss_flop_factor_by_preset.items()}}
    return {
        "coefficients": coeffs,
        "standard_errors": {n: round(float(e), 4) for n, e in zip(names, se, strict=True)},
        "loss_layers": {m: round(costs.loss_factor(preset(m)) * flop_loss_layers(preset(m)), 3)
                        for m in models},
        "command": COMMAND,
        "what": "per-rank busy time = (1 - bubble) x timed_s of each pipeline run; least squares on busy "
                "relative to each run's mean rank, one time scale per machine kind + commit + capacity + "
                "layout; "
                f"{len(runs)} runs, {sum(r.pp for r in runs)} rank values, {len(theta)} coefficients + "
                f"{len({r.group for r in runs})} scales: few points, a per-rank noise floor of about 2%",
        "records": [r.name for r in runs],
        "excluded": {r.name: EXCLUDED[r.model] for r in checks},
        "rms_relative_busy_error": {"fitted": round(_rms(res), 4), "constants_before": round(_rms(res0), 4),
                                    "shares_fitted": round(_rms(sh), 4),
                                    "shares_constants_before": round(_rms(sh0), 4)},
        "residuals": {k: v.round(4).tolist() for k, v in res.items()},
        "residuals_constants_before": {k: v.round(4).tolist() for k, v in res0.items()},
        "leave_one_run_out": loo,
        "checks_excluded": {r.name: {"measured": r.shares.round(4).tolist(),
                                     "predicted": (work(r, costs) / work(r, costs).mean()).round(4).tolist()}
                            for r in checks},
    }


def _print(rep: dict, runs: list[Run]) -> None:
    print("stage cost fit:", json.dumps(rep["coefficients"]))
    print("standard errors:", json.dumps(rep["standard_errors"]))
    print("loss + output layer in decoder layers:", rep["loss_layers"])
    print(rep["what"])
    e = rep["rms_relative_busy_error"]
    print(f"rms error of busy/mean: fitted {e['fitted']:.4f}, constants before {e['constants_before']:.4f}; "
          f"of the shares alone (one scale per run): fitted {e['shares_fitted']:.4f}, before "
          f"{e['shares_constants_before']:.4f}")
    print(f"{'run':<44} {'split':<18} {'recompute':<16} residual per rank (fitted | before)")
    for r in runs:
        print(f"{r.name:<44} {str(list(r.split)):<18} {str(list(r.recompute)):<16} "
              f"{rep['residuals'][r.name]} | {rep['residuals_constants_before'][r.name]}")
    print("leave one run out (fit on the others; predicted - measured busy share per rank):")
    for name, x in rep["leave_one_run_out"].items():
        print(f"  {name:<42} {x['error']}{x['note']}")
    for name, x in rep["checks_excluded"].items():
        print(f"  not fitted: {name}: measured shares {x['measured']}, predicted {x['predicted']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--write", action="store_true", help=f"write {STAGE_COSTS_FILE.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    every = load_runs(args.results)
    runs = [r for r in every if r.model not in EXCLUDED]
    checks = [r for r in every if r.model in EXCLUDED]
    models = sorted({r.model for r in runs}, key=lambda m: -sum(r.model == m for r in runs))
    theta, se = fit(runs, models)
    rep = report(runs, checks, theta, se, models)
    _print(rep, runs)
    if args.write:
        STAGE_COSTS_FILE.write_text(json.dumps(rep, indent=1) + "\n")
        print(f"wrote {STAGE_COSTS_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
