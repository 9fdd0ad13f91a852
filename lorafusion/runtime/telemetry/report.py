"""``lorafusion plan``: the first chunks of a run planned without a model, as tables and charts."""

from __future__ import annotations

import json
from pathlib import Path

from lorafusion.runtime.feed import Feed

CHART_CHUNKS = 2  # chunks drawn in gantt.png and packing.png (each a panel per DP rank)


def write_plan_report(feed: Feed, out_dir: Path, max_chunks: int = 20) -> dict:
    """Plan up to ``max_chunks`` chunks; write ``plan.jsonl`` (one row per microbatch), ``windows.json``
    (one row per chunk: fill, imbalance, simulated bubble, planning time), ``gantt.png`` and
    ``packing.png`` (the first ``CHART_CHUNKS`` chunks, a panel per chunk and DP rank). Returns
    ``{"windows": [...], "dir": ..., "files": [names written]}``."""
    from lorafusion.scheduler import render_chunks, simulate_plan
    from lorafusion.scheduler.simulate import bubble_ratio

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, stats, charted = [], [], []
    for w in range(max_chunks):
        chunk = feed.next()
        if chunk is None:
            break
        the_plan = chunk.plan
        timelines = simulate_plan(the_plan, ranks={n: feed.jobs[n].cfg.lora.r for n in chunk.batches})
        cap = the_plan.token_capacity
        toks = [mb.num_tokens for mb in the_plan.microbatches if not mb.is_noop]
        stats.append({"window": w, "jobs": sorted(chunk.batches), "microbatches": len(the_plan.microbatches),
                      "noops": the_plan.num_noops, "plan_s": round(chunk.plan_s, 4),
                      "fill": sum(toks) / (cap * max(1, len(toks))),
                      "imbalance": max(toks) / (sum(toks) / len(toks)) if toks else None,
                      "simulated_bubble": bubble_ratio(timelines)})
        for mb in the_plan.microbatches:
            rows.append({"window": w, "slot": mb.slot, "dp_rank": mb.dp_rank, "noop": mb.is_noop,
                         "tokens": mb.num_tokens, "segments": mb.segments()})
        if w < CHART_CHUNKS:
            charted.append((the_plan, timelines))
    if charted:
        render_chunks(charted, str(out_dir / "gantt.png"), str(out_dir / "packing.png"),
                      titles=[f"chunk {w}" for w in range(len(charted))])
    (out_dir / "plan.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out_dir / "windows.json").write_text(json.dumps(stats, indent=2) + "\n")
    files = [f for f in ("plan.jsonl", "windows.json", "gantt.png", "packing.png") if (out_dir / f).is_file()]
    return {"windows": stats, "dir": str(out_dir), "files": files}
