"""The plan charts: every job of a microbatch drawn (stacked by its share), a panel per DP rank and chunk,
labelled."""

from __future__ import annotations

from lorafusion.scheduler import JobSpec, SchedulerConfig, plan, render_chunks, simulate_plan
from lorafusion.scheduler.charts import _render, draw_gantt, draw_packing


def _plan(dp: int = 2):
    jobs = [JobSpec(f"j{k}", [[(f"{k}-{i}", 100 + 37 * i) for i in range(8)]], 8) for k in range(3)]
    return plan(jobs, SchedulerConfig(2, dp, 2048, milp_time_limit_s=0.0))


def test_every_job_of_a_microbatch_is_drawn_and_labelled(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = _plan()
    tls = simulate_plan(p)
    colors = {"j0": "red", "j1": "green", "j2": "blue"}
    fig, (a, b) = plt.subplots(2, 1)
    draw_gantt(a, p, tls[1], 1, colors, "chunk 0, ")
    draw_packing(b, p, 1, colors, "chunk 0, ")
    for ax in (a, b):
        drawn = {tuple(round(c, 3) for c in patch.get_facecolor()[:3]) for patch in ax.patches
                 if patch.get_fill()}
        want = {tuple(round(c, 3) for c in matplotlib.colors.to_rgb(colors[j]))
                for mb in p.for_rank(1) for j in mb.jobs}
        assert want <= drawn  # every job present on that rank shows, not only each microbatch's first
        assert "DP rank 1 of 2" in ax.get_title()
    assert a.get_xlabel().startswith("simulated time") and b.get_ylabel() == "tokens"
    assert all(float(t).is_integer() for t in b.get_xticks())  # microbatch slots are whole numbers
    assert any("token capacity" in str(line.get_label()) for line in b.get_lines())
    plt.close(fig)


def test_charts_have_a_panel_per_chunk_and_rank(tmp_path):
    p = _plan()
    render_chunks([(p, simulate_plan(p)), (p, simulate_plan(p))], str(tmp_path / "g.png"),
                  str(tmp_path / "p.png"))
    for name in ("g.png", "p.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _render([(p, None, r, "") for r in range(2)], str(tmp_path / "one.png"), gantt=False)
    assert (tmp_path / "one.png").stat().st_size > 2000


def test_the_gantt_axis_is_the_share_of_the_chunk_whatever_the_model_size():
    """A tiny model's chunk at the FLOP cost model's GPU rate lasts microseconds: the axis read "µs" over
    0-3.5 for steps of thousands of tokens. The axis is the share of the chunk's simulated time, 0-100 %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lorafusion.core.arch import preset
    from lorafusion.scheduler.stages import flop_cost_model

    p = _plan()
    tls = simulate_plan(p, flop_cost_model(preset("tiny-llama")))
    assert tls[0].makespan < 1e-3  # (what made the unit microseconds)
    fig, ax = plt.subplots()
    draw_gantt(ax, p, tls[0], 0, {"j0": "red", "j1": "green", "j2": "blue"}, "")
    assert "% of the chunk" in ax.get_xlabel() and "µs" not in ax.get_xlabel()
    right = max(patch.get_x() + patch.get_width() for patch in ax.patches)
    assert abs(right - 100) < 1e-6 and ax.get_xlim() == (0, 100)
    plt.close(fig)
