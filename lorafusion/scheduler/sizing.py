"""Token capacity, recompute and the stage split for a GPU's memory: ``token_capacity: auto``,
``recompute_layers: auto`` and, with both pipeline stages and ``stage_layers: auto``, the layers per stage.

:func:`choose` walks capacities (multiples of ``multiple`` from the longest sample up to ``max_capacity``)
and, for each, the fewest recomputed layers per stage that make every stage fit (:mod:`.memory`), and keeps
the plan with the most tokens/s by the cost model: time per token ``(a + b·C·B) / C`` with ``B`` the
bottleneck factor — the busiest pipeline rank's work over a perfectly balanced rank's, a rank's work by the
stage cost model fitted to measured per-rank busy time (:mod:`.stagecost`: its decoder layers, an FP8 base's
cheaper; a fraction of a layer per recomputed one; the output layer and loss on the last rank; the first
rank's offset) — and, with pipeline stages, the 1F1B fill and drain ``(pp - 1) / M`` of ``M`` = chunk
tokens / C microbatches.

With ``stage_layers: auto`` and ``recompute_layers: auto`` on a pipeline, the split is chosen with the
recompute: 1F1B holds ``pp - k`` microbatches in flight on stage ``k``, so an early stage runs out of memory
first and must recompute, which makes it the slowest; giving it fewer layers and a later stage more balances
the ranks' work, recompute included (:func:`_balanced_split`). A fixed capacity, recompute or split is kept
and only checked. The plan keeps the alternatives it beat with their predicted time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lorafusion.core.errors import UserError

from .costmodel import CostModel
from .memory import GIB, Coefficients, MemorySetup, StageMemory, plan_memory, stage_memory
from .stagecost import bf16_leading, load_stage_costs, stage_work

__all__ = ["MemoryFitError", "MemoryPlan", "RECOMPUTE_COST", "choose", "memory_reasons", "no_fit_message",
           "oom_advice", "parse_bytes", "rank_loads", "what_fits", "work_line"]

# a recomputed layer's cost over its layer's forward + backward: the stage cost model's fit to measured
# per-rank busy time (stage_costs.json, scripts/fit_stage_costs.py)
RECOMPUTE_COST = load_stage_costs().recompute


class MemoryFitError(UserError):
    """The run cannot fit the GPU's memory at any setting it may change (or at the ones it was given)."""


@dataclass
class MemoryPlan:
    """The chosen (or given) capacity and per-stage recompute, with every stage's prediction."""

    capacity: int
    recompute_layers: list[int]
    stages: list[StageMemory]
    gpu_bytes: float
    chosen: dict  # which of capacity / recompute_layers / stage_layers were "auto"
    # decoder layers per pipeline rank (the chosen split; None: the run's)
    stage_layers: list[int] | None = None
    cost: float | None = None  # predicted seconds per token (the cost model's units: for comparing plans)
    # the best plan of each other capacity / split, beaten
    alternatives: list[dict] = field(default_factory=list)

    def why(self) -> list[str]:
        """The alternatives this plan beat, with their predicted time relative to it."""
        out = []
        for a in self.alternatives:
            split = f", stage_layers {a['stage_layers']}" if a.get("stage_layers") else ""
            rel = f"{a['cost'] / self.cost:.3f}x the time" if a.get("cost") and self.cost else "does not fit"
            what = f" ({a['what']})" if a.get("stage_layers") is not None else ""
            out.append(f"token_capacity {a['token_capacity']}, recompute_layers "
                       f"{a['recompute_layers']}{split}{what}: {rel}")
        return out

    @property
    def fits(self) -> bool:
        return all(s.fits(self.gpu_bytes) for s in self.stages)

    def lines(self) -> list[str]:
        """A table: one row per stage (GiB)."""
        out = [f"{'stage':>5} {'layers':>6} {'recomp':>6} {'in-flt':>6} {'weights':>8} {'lora+opt':>8} "
               f"{'act/mb':>7} {'peak':>7} {'need':>7} {'GPU':>7}  fits"]
        for s in self.stages:
            out.append(f"{s.stage:>5} {s.layers:>6} {s.recompute_layers:>6} {s.in_flight:>6.2f} "
                       f"{s.weights / GIB:>8.1f} {s.lora / GIB:>8.1f} {s.per_microbatch / GIB:>7.2f} "
                       f"{max(s.peak, 0.0) / GIB:>7.1f} {s.need / GIB:>7.1f} {self.gpu_bytes / GIB:>7.1f}  "
                       f"{'yes' if s.fits(self.gpu_bytes) else 'NO'}")
        return out

    def to_dict(self) -> dict:
        return {"token_capacity": self.capacity, "recompute_layers": self.recompute_layers,
                "stage_layers": self.stage_layers, "predicted_cost": self.cost,
                "alternatives": self.alternatives,
                "gpu_memory_gib": round(self.gpu_bytes / GIB, 2), "auto": self.chosen, "fits": self.fits,
                "stages": [{"stage": s.stage, "layers": s.layers, "recompute_layers": s.recompute_layers,
                            "in_flight": s.in_flight, "predicted_peak_gib": round(s.peak / GIB, 2),
                            "need_gib": round(s.need / GIB, 2)} for s in self.stages]}


def parse_bytes(text: str) -> float:
    """``80GiB``, ``80GB`` (= GiB here: what GPUs are sold as), ``81920MiB`` or a plain number of GiB."""
    t = str(text).strip().lower().replace(" ", "")
    for unit, mult in (("gib", GIB), ("gb", GIB), ("g", GIB), ("mib", 1 << 20), ("mb", 1 << 20),
                       ("tib", 1 << 40)):
        if t.endswith(unit):
            t, scale = t[: -len(unit)], mult
            break
    else:
        scale = GIB
    try:
        v = float(t) * scale
    except ValueError:
        raise ValueError(f"expected a memory size such as 80GiB, 48GB or 24, got {text!r}") from None
    if not v > 0:
        raise ValueError(f"expected a positive memory size, got {text!r}")
    return v


def _round_up(tokens: int, multiple: int = 512) -> int:
    """The smallest multiple of ``multiple`` holding ``tokens``: the least capacity for samples that long."""
    return -(-max(1, tokens) // multiple) * multiple


def _largest_with_full_recompute(s: MemorySetup, gpu: float, c: Coefficients | None, lo: int, hi: int,
                                 multiple: int = 512) -> int | None:
    """The largest capacity from ``lo`` to ``hi`` (multiples of ``multiple``) at which every stage fits
    ``gpu`` with every layer recomputed (None: not even ``lo``); memory grows with the capacity, so the walk
    stops at the first that does not fit."""
    full, best = [s.layers(k) for k in range(s.pp)], None
    for cap in range(lo, hi + 1, multiple):
        if not all(m.fits(gpu) for m in plan_memory(s, cap, full, c)):
            break
        best = cap
    return best


def _fewest(s: MemorySetup, stage: int, capacity: int, gpu: float, c: Coefficients) -> int | None:
    """The fewest recomputed layers of ``stage`` that fit ``gpu`` bytes at ``capacity`` (None: none fits;
    memory falls as layers are recomputed, so a bisection finds it)."""
    L = s.layers(stage)
    if not stage_memory(s, stage, capacity, L, c).fits(gpu):
        return None
    lo, hi = 0, L
    while lo < hi:
        mid = (lo + hi) // 2
        if stage_memory(s, stage, capacity, mid, c).fits(gpu):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _loss(s: MemorySetup) -> float:
    from .stages import loss_layers

    return loss_layers(s.arch)


def _bf16_layers(s: MemorySetup, stage: int, layers: int) -> int:
    """Of ``layers`` decoder layers on ``stage`` (one model chunk per rank), those in bf16: all with a bf16
    base; with an FP8 base the model's leading ones kept in bf16 (stage 0)."""
    lead = bf16_leading(s)
    if lead is None:
        return layers
    return min(layers, lead) if stage == 0 else 0


def _stage_work(s: MemorySetup, stage: int, layers: int, rc: int) -> float:
    return stage_work(layers, rc, _bf16_layers(s, stage, layers), load_stage_costs(), stage == 0,
                      stage == s.pp - 1, _loss(s))


def rank_loads(s: MemorySetup, rc: Sequence[int]) -> list[float]:
    """Each pipeline rank's work in bf16 decoder-layer units (:mod:`.stagecost`): its layers (an FP8 base's
    cheaper), the recomputed ones' extra, the output layer and loss on the last, the first rank's offset."""
    return [_stage_work(s, k, s.layers(k), rc[k]) for k in range(s.pp)]


def _score(s: MemorySetup, capacity: int, rc: Sequence[int], cost: CostModel,
           chunk_tokens: float | None) -> float:
    """Predicted seconds per token (lower is better): the busiest rank sets the pace of 1F1B."""
    loads = rank_loads(s, rc)
    balanced = sum(rank_loads(s, [0] * s.pp)) / s.pp
    t = (cost.a + cost.b * capacity * max(loads) / balanced) / capacity
    if s.pp > 1 and chunk_tokens:
        t *= 1 + (s.pp - 1) / max(1.0, chunk_tokens / capacity)
    return t


def _balanced_split(s: MemorySetup, capacity: int, gpu: float, c: Coefficients) -> list[int] | None:
    """Decoder layers per pipeline rank (one model chunk each) that make the busiest rank's work, recompute
    included, the least while every stage fits: the smallest work bound ``T`` whose largest fitting layer
    counts per rank add up to the model's layers, then layers taken off the busiest ranks down to that
    total."""
    n_layers, P = s.arch.num_layers, s.pp
    # per rank: layer count -> work at its fewest recompute (only counts that fit)
    work: list[dict[int, float]] = []
    for k in range(P):
        w = {}
        for L in range(1, n_layers - P + 2):
            sk = replace(s, stage_layers=tuple(L if i == k else 1 for i in range(P)))
            n = _fewest(sk, k, capacity, gpu, c)
            if n is None:
                break
            w[L] = _stage_work(s, k, L, n)
        if not w:
            return None
        work.append(w)

    def largest(T: float) -> list[int]:
        return [max((L for L, x in w.items() if x <= T + 1e-9), default=0) for w in work]

    bounds = sorted({x for w in work for x in w.values()})
    lo, hi = 0, len(bounds) - 1
    if sum(largest(bounds[hi])) < n_layers:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(largest(bounds[mid])) >= n_layers else (mid + 1, hi)
    split = largest(bounds[lo])
    # the surplus off the busiest rank (ties: the earliest, which holds the most)
    while sum(split) > n_layers:
        k = max((i for i in range(P) if split[i] > 1), key=lambda i: (work[i][split[i]], -i))
        split[k] -= 1
    return split


def _candidate(s: MemorySetup, cap: int, gpu: float, c: Coefficients, recompute, split_auto: bool):
    """(setup, recompute per stage) of the best plan at capacity ``cap``, or None when nothing fits."""
    if split_auto:
        split = _balanced_split(s, cap, gpu, c)
        if split is None:
            return None
        s = replace(s, stage_layers=tuple(split))
    if recompute == "auto":
        rc = [_fewest(s, k, cap, gpu, c) for k in range(s.pp)]
        return None if any(n is None for n in rc) else (s, rc)
    rc = [recompute] * s.pp if isinstance(recompute, int) else list(recompute)
    return (s, rc) if all(m.fits(gpu) for m in plan_memory(s, cap, rc, c)) else None


def choose(s: MemorySetup, gpu_bytes: float, longest: int, *, capacity: int | str = "auto",
           recompute: int | Sequence[int] | str = "auto", coeffs: Coefficients | None = None,
           cost_model: CostModel | None = None, chunk_tokens: float | None = None, multiple: int = 512,
           max_capacity: int = 32768, split: str | None = None) -> MemoryPlan:
    """The plan for ``gpu_bytes`` of memory per GPU. ``capacity`` / ``recompute`` (a count for every stage, or
    one per stage): a value is kept, ``"auto"`` is chosen. ``split="auto"`` (the run's ``stage_layers: auto``)
    with recompute ``"auto"`` on a pipeline of one model chunk per rank chooses the layers per stage too (else
    the setup's split is kept). Never raises: a plan that does not fit has ``fits`` False (the smallest
    capacity tried at the most recompute allowed)."""
    c, cost = coeffs or Coefficients(), cost_model or CostModel()
    split_auto = split == "auto" and recompute == "auto" and s.pp > 1 and s.virtual_stages == 1
    chosen = {"token_capacity": capacity == "auto", "recompute_layers": recompute == "auto",
              "stage_layers": split_auto}
    lo = _round_up(longest, multiple)
    caps = [int(capacity)] if capacity != "auto" else list(range(lo, max(lo, max_capacity) + 1, multiple))
    found = []  # (score, capacity, setup, rc, what)
    for cap in caps:
        n = len(found)
        for what, auto_split in (("memory-balanced split", True), ("the run's split", False)):
            if auto_split and not split_auto:
                continue
            got = _candidate(s, cap, gpu_bytes, c, recompute, auto_split)
            if got is not None:
                found.append((_score(got[0], cap, got[1], cost, chunk_tokens), cap, got[0], got[1], what))
        if found and len(found) == n:  # memory grows with the capacity: a larger one fits no better
            break
    if not found:  # nothing fits: report the smallest capacity tried at the most recompute allowed
        cap = caps[0]
        rc = [s.layers(k) for k in range(s.pp)] if recompute == "auto" else (
            [recompute] * s.pp if isinstance(recompute, int) else list(recompute))
        return MemoryPlan(cap, rc, plan_memory(s, cap, rc, c), gpu_bytes, chosen)
    best = min(found, key=lambda f: (f[0], f[1]))
    score, cap, bs, rc, _ = best
    seen, alts = {(best[1], tuple(best[2].layers(k) for k in range(s.pp)), tuple(best[3]))}, []
    for f in sorted(found, key=lambda f: f[0]):  # distinct plans only (both splits may give the same one)
        key = (f[1], tuple(f[2].layers(k) for k in range(s.pp)), tuple(f[3]))
        if key not in seen:
            seen.add(key)
            alts.append(f)
    other_kind = [f for f in alts if f[4] != best[4]][:1]  # the best plan of the other split, if any
    alts = other_kind + [f for f in alts if f not in other_kind][:4 - len(other_kind)]
    alternatives = [{"what": f[4], "token_capacity": f[1], "recompute_layers": f[3],
                     "stage_layers": [f[2].layers(k) for k in range(s.pp)] if s.pp > 1 else None,
                     "cost": f[0]}
                    for f in alts[:4]]
    layers = [bs.layers(k) for k in range(s.pp)]
    return MemoryPlan(cap, rc, plan_memory(bs, cap, rc, c), gpu_bytes, chosen,
                      stage_layers=layers if split_auto else None, cost=score, alternatives=alternatives)


def work_line(s: MemorySetup, memory: MemoryPlan) -> str:
    """The plan's predicted work per pipeline rank (:func:`rank_loads`) and the busiest over the mean."""
    split = replace(s, stage_layers=tuple(memory.stage_layers)) if memory.stage_layers else s
    loads = rank_loads(split, memory.recompute_layers)
    return (f"rank work per microbatch (bf16 decoder layers, fitted stage costs: recompute, loss, FP8): "
            f"[{', '.join(f'{x:.2f}' for x in loads)}], busiest/mean "
            f"{max(loads) * len(loads) / sum(loads):.3f}")


def memory_reasons(s: MemorySetup, memory: MemoryPlan, longest: int, coeffs: Coefficients, recompute,
                   capacity: int | str, chunk_tokens: float | None) -> tuple[str, ...]:
    """Why the memory plan is what it is: what the plan without recompute would cost (or that nothing fits
    without it), then the alternatives that fit with their predicted time per token (``recompute`` and
    ``capacity``: the run's settings, "auto" or values)."""
    out = []
    if memory.fits and recompute == "auto" and any(memory.recompute_layers):
        bare = choose(s, memory.gpu_bytes, longest, capacity=capacity, recompute=0, coeffs=coeffs,
                      chunk_tokens=chunk_tokens)
        out.append("without recompute: " + (
            f"token_capacity {bare.capacity} fits, predicted {bare.cost / memory.cost:.3f}x the time "
            "per token"
            if bare.fits and bare.cost and memory.cost else
            f"nothing fits (at {bare.capacity} tokens a stage needs "
            f"{max(m.need for m in bare.stages) / GIB:.1f} GiB)"))
    if s.pp > 1 and s.virtual_stages == 1:
        out.append(work_line(s, memory))
    if memory.why():
        out += ["why: alternatives that fit, by the cost model's time per token (larger microbatches "
                "amortise their fixed cost; recomputed layers cost time)", *("  " + x for x in memory.why())]
    return tuple(out)


def what_fits(s: MemorySetup, gpu_bytes: float, longest: int, capacity: int, recompute: Sequence[int],
              coeffs: Coefficients | None = None) -> list[str]:
    """Settings that would make a plan fit, in words (empty when nothing in reach does)."""
    out = []
    keep_rc = choose(s, gpu_bytes, longest, capacity="auto", recompute=list(recompute), coeffs=coeffs)
    if keep_rc.fits:
        out.append(
            f"scheduler.token_capacity: {keep_rc.capacity} (the largest that fits with this recompute)")
    keep_cap = choose(s, gpu_bytes, longest, capacity=capacity, recompute="auto", coeffs=coeffs)
    if keep_cap.fits:
        out.append(f"model.recompute: true, model.recompute_layers: {max(keep_cap.recompute_layers)} "
                   f"(the fewest per stage that fit at token_capacity {capacity}; auto picks "
                   f"{keep_cap.recompute_layers} per stage)")
    both = choose(s, gpu_bytes, longest, coeffs=coeffs)
    if both.fits:
        out.append(f"scheduler.token_capacity: auto and model.recompute_layers: auto (here: {both.capacity} "
                   f"tokens, {both.recompute_layers} recomputed layers per stage)")
    return out


def oom_advice(s: MemorySetup, plan: MemoryPlan, stage: int, actual_peak: float, longest: int,
               coeffs: Coefficients | None = None) -> list[str]:
    """Settings the run's config accepts that fit once the memory model is corrected by what ``stage`` used
    beyond its prediction (``actual_peak`` allocated bytes when it ran out of memory): a recompute count for
    every stage (at the run's capacity and split), then full recompute at the largest capacity that fits, each
    checked on every stage. Never a capacity below ``longest`` (the longest sample must fit one microbatch)
    nor the setting the run already has."""
    c = coeffs or Coefficients()
    over = actual_peak - plan.stages[stage].peak  # (nan: the peak is not known)
    miss = (over if over > 0 else 0.0) + 0.5 * GIB  # the model's miss, and room beside it
    budget = plan.gpu_bytes - miss
    split = f", parallelism.stage_layers: {plan.stage_layers}" if plan.stage_layers else ""
    bs = replace(s, stage_layers=tuple(plan.stage_layers)) if plan.stage_layers else s
    out = []
    for n in range(max(plan.recompute_layers) + 1, max(bs.layers(k) for k in range(bs.pp))):
        if all(m.fits(budget)
               for m in plan_memory(bs, plan.capacity, [min(n, bs.layers(k)) for k in range(bs.pp)], c)):
            out.append(f"model.recompute_layers: {n} (the first {n} layers of every stage){split}, "
                       f"scheduler.token_capacity: {plan.capacity}")
            break
    full = [bs.layers(k) for k in range(bs.pp)]
    cap = _largest_with_full_recompute(bs, budget, c, _round_up(longest), 65536)
    if cap is not None and (cap != plan.capacity or plan.recompute_layers != full):
        out.append(f"model.recompute: true with model.recompute_layers unset (every layer){split}, "
                   f"scheduler.token_capacity: {cap}")
    return out


def no_fit_message(s: MemorySetup, plan: MemoryPlan, longest: dict[str, int], source: str,
                   coeffs: Coefficients | None = None) -> str:
    """Why ``plan`` does not fit and what would: the job whose samples set the smallest capacity, the stage
    over the limit with its predicted need, and the settings in reach."""
    worst = max(plan.stages, key=lambda m: m.need - plan.gpu_bytes)
    job = max(longest, key=longest.get) if longest else None
    head = (f"{source}: the run does not fit {plan.gpu_bytes / GIB:.1f} GiB of GPU memory: at token_capacity "
            f"{plan.capacity} with {plan.recompute_layers[worst.stage]} of {worst.layers} decoder layers "
            f"recomputed, pipeline stage {worst.stage} needs {worst.need / GIB:.1f} GiB (predicted peak "
            f"{max(worst.peak, 0.0) / GIB:.1f} GiB + margin)")  # (the fitted model can go below 0 there)
    if job is not None and plan.chosen.get("token_capacity"):
        head += f"; job {job!r} has samples of up to {longest[job]} tokens (its dataset.max_seq_len)"
    fixes = what_fits(s, plan.gpu_bytes, max(longest.values(), default=1), plan.capacity,
                      plan.recompute_layers, coeffs) if not all(plan.chosen.values()) else []
    if not fixes:
        cap = _largest_with_full_recompute(s, plan.gpu_bytes, coeffs, 512, plan.capacity)
        if cap is not None and cap < plan.capacity:
            fixes.append(f"dataset.max_seq_len: {cap} or less with truncate: true on the jobs over it "
                         f"(fits with every layer recomputed)")
        # (advised only where the model fits it)
        low = _round_up(max(longest.values(), default=1))
        fixes += [f"more pipeline stages (parallelism.pp: {pp})" for pp in (2 * s.pp, 4 * s.pp)
                  if s.arch.num_layers % pp == 0
                  and what_fits(replace(s, pp=pp, stage_layers=None), plan.gpu_bytes, low, low, [0] * pp,
                                coeffs)][:1]
        fixes += ["tensor parallelism (parallelism.tp) or a GPU with more memory"] if fixes else []
    return head + (". Would fit: " + "; or ".join(fixes) if fixes else
                   ". Nothing within this run's settings fits: a GPU with more memory, or tensor parallelism "
                   "(parallelism.tp)")

