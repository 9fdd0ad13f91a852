"""``lorafusion plan``: the first chunks of a run planned without a model, as tables and charts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorafusion.resolve import RunPlan, World, resolve, run_arch
from lorafusion.runtime.feed import Feed

CHART_CHUNKS = 2  # chunks drawn in gantt.png and packing.png (each a panel per DP rank)


@dataclass
class StageModel:
    """What the simulator needs of a run's pipeline: its split per virtual stage and the costs."""

    virtual_stages: int
    split: list[int]
    loss_layers: float
    cost_model: object
    stage_costs: list[tuple[float, float]]


def stage_model(cfg, plan: RunPlan) -> StageModel:
    """The run's resolved ``virtual_stages`` and ``stage_layers`` with the FLOP cost model of its architecture
    (scheduler/stages.py: the output layer and loss counted on the last virtual stage)."""
    from lorafusion.scheduler import stages

    arch = run_arch(cfg)
    loss = stages.loss_layers(arch)
    split = list(plan.stage_layers)
    return StageModel(plan.virtual_stages, split, loss, stages.flop_cost_model(arch, loss, tp=plan.tp),
                      stages.stage_costs(split, loss))


class Progress:
    """``plan: ...`` lines on stderr while a plan runs: each pass's start and, every ``every_s`` seconds, how
    far it got (a sweep of the 70B config plans for a minute)."""

    def __init__(self, every_s: float = 2.0, stream=None):
        import sys
        import time

        self.every_s, self.stream, self._clock = every_s, stream or sys.stderr, time.monotonic
        self.t0 = self._last = self._clock()

    def start(self, what: str, chunks: int) -> None:
        self.what, self.chunks = what, chunks
        print(f"plan: {what}: planning up to {chunks} chunks ({self._clock() - self.t0:.0f}s so far)",
              file=self.stream, flush=True)
        self._last = self._clock()

    def step(self, done: int) -> None:
        if self._clock() - self._last >= self.every_s:
            self._last = self._clock()
            print(
                f"plan: {self.what}: {done}/{self.chunks} chunks planned ({self._last - self.t0:.0f}s so "
                "far)",
                  file=self.stream, flush=True)


def plan_chunks(feed: Feed, max_chunks: int, progress: Progress | None = None, what: str = "run") -> list:
    """The feed's first ``max_chunks`` chunks, planned (fewer when the jobs end sooner)."""
    if progress:
        progress.start(what, max_chunks)
    chunks = []
    for c in range(max_chunks):
        if (chunk := feed.next()) is None:
            break
        chunks.append(chunk)
        if progress:
            progress.step(c + 1)
    return chunks


def write_plan_report(feed: Feed, out_dir: Path, max_chunks: int = 20, stage: StageModel | None = None,
                      charts: bool = True, chunks: list | None = None,
                      progress: Progress | None = None) -> dict:
    """Plan up to ``max_chunks`` chunks (or take the planned ``chunks``); write ``plan.jsonl`` (one row per
    microbatch), ``windows.json`` (one row per chunk: fill, imbalance, simulated bubble overall and per stage,
    planning time), ``gantt.png`` and ``packing.png`` (the first ``CHART_CHUNKS`` chunks, a panel per chunk
    and DP rank). ``stage``: the pipeline's split and costs (default: equal stages, the default cost
    model). Returns
    ``{"chunks": [the rows of windows.json], "dir": ..., "files": [names written], "planned": [the chunks]}``.
    (The files name a chunk's index "window", as they always have: one thing, a chunk.)"""
    from lorafusion.scheduler import render_chunks, simulate_plan
    from lorafusion.scheduler.simulate import bubble_ratio

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    planned = plan_chunks(feed, max_chunks, progress) if chunks is None else chunks
    rows, stats, charted = [], [], []
    for c, chunk in enumerate(planned):
        the_plan = chunk.plan
        timelines = simulate_plan(the_plan, stage.cost_model if stage else None,
                                  ranks={n: feed.jobs[n].cfg.lora.r for n in chunk.batches},
                                  stage_costs=stage.stage_costs if stage else None)
        cap = the_plan.token_capacity
        toks = [mb.num_tokens for mb in the_plan.microbatches if not mb.is_noop]
        stats.append({"window": c, "jobs": sorted(chunk.batches), "microbatches": len(the_plan.microbatches),
                      "noops": the_plan.num_noops, "plan_s": round(chunk.plan_s, 4),
                      "fill": sum(toks) / (cap * max(1, len(toks))),
                      "imbalance": max(toks) / (sum(toks) / len(toks)) if toks else None,
                      "simulated_bubble": bubble_ratio(timelines),
                      "simulated_bubble_per_stage": timelines[0].stage_bubbles})
        for mb in the_plan.microbatches:
            rows.append({"window": c, "slot": mb.slot, "dp_rank": mb.dp_rank, "noop": mb.is_noop,
                         "tokens": mb.num_tokens, "segments": mb.segments()})
        if c < CHART_CHUNKS and charts:
            charted.append((the_plan, timelines))
    if charted:
        render_chunks(charted, str(out_dir / "gantt.png"), str(out_dir / "packing.png"),
                      titles=[f"chunk {c}" for c in range(len(charted))])
    (out_dir / "plan.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out_dir / "windows.json").write_text(json.dumps(stats, indent=2) + "\n")
    files = [f for f in ("plan.jsonl", "windows.json", "gantt.png", "packing.png") if (out_dir / f).is_file()]
    return {"chunks": stats, "dir": str(out_dir), "files": files, "planned": planned}


def steady_bubble(chunks: list[dict]) -> tuple[float, list[float]] | None:
    """Mean simulated bubble (overall, per stage) over the chunks after the first (the first alone if one)."""
    rows = chunks[1:] or chunks
    if not rows:
        return None
    per = [sum(r["simulated_bubble_per_stage"][s] for r in rows) / len(rows)
           for s in range(len(rows[0]["simulated_bubble_per_stage"]))]
    return sum(r["simulated_bubble"] for r in rows) / len(rows), per


def sweep_virtual(cfg, world: World, virtuals: list[int], max_chunks: int, out_dir: Path,
                  planned: dict | None = None, progress: Progress | None = None) -> list[dict]:
    """For each V: the run's chunks planned for V (once: the split changes the simulation, not the plan; the
    chunks of ``planned[V]`` are taken as they are), simulated with the even split (when it exists) and the
    loss-aware ``auto`` split; one row per (V, split) with the steady bubble overall and per stage."""
    from lorafusion.core.errors import ConfigError
    from lorafusion.runtime.jobs import load_jobs

    rows, planned, feeds = [], dict(planned or {}), {}
    for V in virtuals:
        for name, layers in (("even", None), ("auto", "auto")):
            layout = cfg.parallelism.model_copy(update={"virtual_stages": V, "stage_layers": layers})
            # (a copy: the loaded config stays as it is)
            cfg_v = cfg.model_copy(update={"parallelism": layout})
            try:
                plan_v = resolve(cfg_v, world, None)
            except ConfigError:  # no even split for this V
                continue
            st = stage_model(cfg_v, plan_v)
            if V not in feeds:  # (a feed's jobs give the simulation their ranks)
                feeds[V] = Feed(load_jobs(cfg_v)[1], plan_v.scheduler, dp_rank=None)
            if V not in planned:
                planned[V] = plan_chunks(feeds[V], max_chunks, progress, f"virtual_stages={V}")
            res = write_plan_report(feeds[V], out_dir / f"v{V}-{name}", max_chunks, st, charts=False,
                                    chunks=planned[V])
            if (b := steady_bubble(res["chunks"])) is not None:
                rows.append({"virtual_stages": V, "split": name, "stage_layers": st.split, "bubble": b[0],
                             "bubble_per_stage": b[1]})
    return rows
