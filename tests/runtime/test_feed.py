"""The feed: chunks prepared on a background thread are exactly the sequentially prepared ones, carry their
jobs' stream states as of their own end, and a planning error reaches the caller."""

import numpy as np
import pytest
import torch

from runtime_utils import three_job_dicts, write_run


def _feed(tmp_path, background: bool, out: str, overrides=("scheduler.solver=greedy",)):
    from lorafusion.config import load_run_config
    from lorafusion.runtime.feed import Feed, load_jobs, scheduler_config

    jobs = three_job_dicts(tmp_path)
    for j in jobs:
        j["max_steps"] = 5  # 5 steps in chunks of 2: the last chunk is short
    # by default plans that do not depend on time (greedy), so planning is deterministic on a loaded machine
    cfg = load_run_config(write_run(tmp_path, jobs, out=out), list(overrides))
    tokenizer, state = load_jobs(cfg)
    return Feed(state, scheduler_config(cfg), dp_rank=0, eos_id=tokenizer.eos_id, background=background)


def _chunks(feed):
    out = []
    while (chunk := feed.next()) is not None:
        out.append(chunk)
    return out


def test_background_feed_hands_out_exactly_the_sequential_chunks(tmp_path):
    seq, bg = _chunks(_feed(tmp_path, False, "a")), _chunks(_feed(tmp_path, True, "b"))
    assert len(seq) == len(bg) == 3
    for a, b in zip(seq, bg):
        assert a.batches == b.batches and a.stream_states == b.stream_states
        assert a.plan.microbatches == b.plan.microbatches and a.plan.last_microbatch == b.plan.last_microbatch
        assert len(a.packed) == len(b.packed)
        for (pa, ba), (pb, bb) in zip(a.packed, b.packed):
            assert ba == bb and pa.adapters == pb.adapters and pa.routing.segments == pb.routing.segments
            assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.labels, pb.labels)
            assert np.array_equal(pa.routing.row_ids, pb.routing.row_ids)


def test_chunks_carry_stream_states_as_of_their_end(tmp_path):
    feed = _feed(tmp_path, True, "c", overrides=())
    drawn = {name: 0 for name in feed.jobs}
    for chunk in _chunks(feed):
        for name, batches in chunk.batches.items():
            assert [b for b, _ in batches] == list(range(drawn[name], drawn[name] + len(batches)))
            drawn[name] += len(batches)
        # what a checkpoint after this chunk records: every batch up to this chunk's end, none of the next
        assert {n: s["steps_done"] for n, s in chunk.stream_states.items()} == drawn
        for name, js in feed.jobs.items():  # and the live stream continues from exactly there
            assert js.stream.steps_done >= drawn[name]
    assert drawn == {"rev": 5, "up": 5, "rev2": 5}


def test_a_planning_error_on_the_background_thread_reaches_the_caller(tmp_path, monkeypatch):
    import lorafusion.runtime.feed as feed_mod
    from lorafusion.scheduler import PlanError

    def broken(specs, config):
        raise PlanError("planner broke")

    monkeypatch.setattr(feed_mod, "plan", broken)
    with pytest.raises(PlanError, match="planner broke"):
        _feed(tmp_path, True, "d").next()
