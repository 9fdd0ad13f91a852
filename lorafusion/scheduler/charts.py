"""Charts of a plan (matplotlib, imported lazily): the simulated 1F1B Gantt and the packing of microbatches.

Both are read without the code: every microbatch is drawn stacked by job (each job's share of its tokens), so
a job present in nearly every microbatch shows in every bar; one panel per DP rank (a rank's own microbatches)
and per chunk when several are given; axes, the capacity line, forward/backward shading and no-op slots are
labelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from .spec import Plan


def _colors(jobs: Sequence[str]) -> dict[str, object]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(jobs) <= 10 else "tab20"]
    return {j: cmap(k % cmap.N) for k, j in enumerate(jobs)}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _jobs(plans: Sequence[Plan]) -> list[str]:
    return list(dict.fromkeys(j for p in plans for mb in p.microbatches for j in mb.jobs))


def _shares(mb) -> list[tuple[str, float]]:
    """(job, share of the microbatch's tokens) in packing order."""
    total = sum(length for _, _, length in mb.segments()) or 1
    return [(job, length / total) for job, _, length in mb.segments()]


def _rank_label(plan: Plan, dp_rank: int) -> str:
    return f"DP rank {dp_rank} of {plan.dp_size}" if plan.dp_size > 1 else "one DP rank"


def draw_gantt(ax, plan: Plan, timeline, dp_rank: int, colors: dict, title: str) -> None:
    """One rank's simulated 1F1B: a row per pipeline stage; each op's bar split by height into its jobs' token
    shares; forwards light, backwards dark; the microbatch's slot number on it where it fits. Time is the
    share of the chunk's simulated makespan (%): the FLOP cost model ranks and balances ops, it does not time
    a device (a tiny model's chunk at a GPU's FLOP rate is microseconds)."""
    import matplotlib.colors as mcolors

    mbs = plan.for_rank(dp_rank)
    span = max(timeline.makespan, 1e-30)
    scale = 100.0 / span
    interleaved = any(getattr(o, "chunk", 0) for o in timeline.ops)
    fill: dict[str, list] = {"y": [], "width": [], "height": [], "left": [], "color": []}
    edge: dict[str, list] = {"y": [], "width": [], "left": []}
    for o in timeline.ops:
        mb = mbs[o.slot]
        if mb.is_noop or o.end <= o.start:
            continue
        start, width, bottom = o.start * scale, (o.end - o.start) * scale, o.stage - 0.4
        for job, share in _shares(mb):
            fill["y"].append(bottom + 0.8 * share / 2)
            fill["height"].append(0.8 * share)
            fill["width"].append(width)
            fill["left"].append(start)
            fill["color"].append(mcolors.to_rgba(colors[job], 0.45 if o.kind == "F" else 1.0))
            bottom += 0.8 * share
        edge["y"].append(o.stage)
        edge["width"].append(width)
        edge["left"].append(start)
        if (o.end - o.start) / span > 0.02:
            label = f"{o.kind}{o.slot}" + (f".{o.chunk}" if interleaved else "")
            ax.text(start + width / 2, o.stage, label, ha="center", va="center", fontsize=6)
    # one call per layer of bars: thousands of single-bar calls took a minute for the 70B chunks
    if fill["y"]:
        ax.barh(fill.pop("y"), fill.pop("width"), linewidth=0, **fill)
        ax.barh(edge.pop("y"), edge.pop("width"), height=0.8, fill=False, edgecolor="black",
                linewidth=0.4, **edge)
    ax.set_yticks(range(timeline.num_stages), [f"PP stage {s}" for s in range(timeline.num_stages)])
    ax.set_ylim(timeline.num_stages - 0.5, -0.5)
    ax.set_xlim(0, 100)
    ax.set_xlabel(
        "simulated time, % of the chunk (the plan's FLOP cost model: relative, not a device's time)")
    noops = sum(mb.is_noop for mb in mbs)
    slots = f" + {noops} no-op slot{'s' if noops > 1 else ''} (nothing runs)" if noops else ""
    ax.set_title(f"{title}{_rank_label(plan, dp_rank)}, simulated 1F1B: {len(mbs) - noops} "
                 f"microbatches{slots}, bubble {timeline.bubble_ratio:.1%}", fontsize=9)


def draw_packing(ax, plan: Plan, dp_rank: int, colors: dict, title: str) -> None:
    """One rank's microbatches: tokens per slot stacked by job, the token capacity as a labelled line."""
    mbs = plan.for_rank(dp_rank)
    bars: dict[str, list] = {"x": [], "height": [], "bottom": [], "color": []}
    for mb in mbs:
        bottom = 0
        for job, _, length in mb.segments():
            bars["x"].append(mb.slot)
            bars["height"].append(length)
            bars["bottom"].append(bottom)
            bars["color"].append(colors[job])
            bottom += length
        if mb.is_noop:
            ax.text(mb.slot, plan.token_capacity * 0.02, "no-op", rotation=90, ha="center",
                    va="bottom", fontsize=6)
    if bars["x"]:
        ax.bar(bars.pop("x"), bars.pop("height"), width=0.8, edgecolor="white", linewidth=0.3, **bars)
    ax.axhline(plan.token_capacity, color="black", linestyle="--", linewidth=0.8,
               label=f"token capacity ({plan.token_capacity:,})")
    slots = [mb.slot for mb in mbs]
    step = max(1, len(slots) // 40)  # integer ticks, thinned when there are many slots
    ax.set_xticks(slots[::step])
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlim(min(slots, default=0) - 0.6, max(slots, default=0) + 0.6)
    ax.set_ylim(0, plan.token_capacity * 1.12)
    ax.set_xlabel("microbatch slot (pipeline order)")
    ax.set_ylabel("tokens")
    toks = [mb.num_tokens for mb in mbs if not mb.is_noop]
    fill = sum(toks) / (plan.token_capacity * max(1, len(toks)))
    ax.set_title(f"{title}{_rank_label(plan, dp_rank)}: {len(toks)} microbatches, mean fill "
                 f"{fill:.0%}", fontsize=9)


def _legend(fig, jobs: Sequence[str], colors: dict, gantt: bool, capacities: Sequence[int] = ()) -> None:
    plt = _plt()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[j]) for j in jobs]
    labels = list(jobs)
    if gantt:
        handles += [plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.45),
                    plt.Rectangle((0, 0), 1, 1, color="grey")]
        labels += ["forward (light; F<slot>[.<model chunk>])", "backward (dark; B<slot>[.<model chunk>])"]
    else:
        handles.append(plt.Line2D([0], [0], color="black", linestyle="--", linewidth=0.8))
        caps = sorted(set(capacities))
        labels.append(f"token capacity ({caps[0]:,} tokens)" if len(caps) == 1
                      else "token capacity (per panel)")
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=8, frameon=False,
               title="each bar split by job: its share of the microbatch's tokens" if gantt else
               "each bar stacked by job: its tokens in the microbatch", title_fontsize=8)


def _render(panels: Sequence[tuple], path: str, gantt: bool) -> None:
    """``panels``: (plan, that rank's timeline or None, DP rank, title prefix), drawn top to bottom."""
    plt = _plt()
    jobs = _jobs([p for p, *_ in panels])
    colors = _colors(jobs)
    heights = [(0.45 * p.pipeline_depth + 1.3) if gantt else 2.8 for p, *_ in panels]
    total = sum(heights) + 1.0
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, total), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (p, tl, r, title) in zip(axes[:, 0], panels, strict=True):
        if gantt:
            draw_gantt(ax, p, tl, r, colors, title)
        else:
            draw_packing(ax, p, r, colors, title)
    _legend(fig, jobs, colors, gantt, [p.token_capacity for p, *_ in panels])
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.9 / total))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_chunks(chunks: Sequence[tuple[Plan, Sequence]], gantt_path: str | None, packing_path: str | None,
                  titles: Sequence[str] | None = None) -> None:
    """Gantt and packing PNGs of several chunks: one panel per (chunk, DP rank). ``chunks``: (plan, one
    simulated timeline per DP rank); ``titles``: a prefix per chunk (default "chunk i")."""
    titles = list(titles) if titles is not None else [f"chunk {i}" for i in range(len(chunks))]
    panels = [(p, tls[r], r, f"{titles[i]}, ") for i, (p, tls) in enumerate(chunks) for r in range(p.dp_size)]
    if panels and gantt_path:
        _render(panels, gantt_path, gantt=True)
    if panels and packing_path:
        _render(panels, packing_path, gantt=False)


def render_gantt(plan: Plan, timeline, path: str, dp_rank: int = 0, title: str = "") -> None:
    """Gantt PNG of one rank's simulated 1F1B (``timeline``); a list of one timeline per rank draws every
    rank."""
    prefix = f"{title}, " if title else ""
    if isinstance(timeline, list | tuple):
        _render([(plan, tl, r, prefix) for r, tl in enumerate(timeline)], path, gantt=True)
    else:
        _render([(plan, timeline, dp_rank, prefix)], path, gantt=True)


def render_packing(plan: Plan, path: str, dp_rank: int | None = None, title: str = "") -> None:
    """Packing PNG: one panel per DP rank (or only ``dp_rank``)."""
    prefix = f"{title}, " if title else ""
    ranks = range(plan.dp_size) if dp_rank is None else [dp_rank]
    _render([(plan, None, r, prefix) for r in ranks], path, gantt=False)


__all__ = ["draw_gantt", "draw_packing", "render_chunks", "render_gantt", "render_packing"]
