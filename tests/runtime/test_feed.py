"""The feed: chunks prepared on a background thread are exactly the sequentially prepared ones, carry their
jobs' stream states as of their own end, and a planning error reaches the caller."""

import numpy as np
import pytest
import torch

from runtime_utils import three_job_dicts, write_run


def _feed(tmp_path, background: bool, out: str, overrides=("scheduler.solver=greedy",)):
    from lorafusion.config import load_run_config
    from lorafusion.resolve import World, resolve
    from lorafusion.runtime.feed import Feed
    from lorafusion.runtime.jobs import load_jobs

    jobs = three_job_dicts(tmp_path)
    for j in jobs:
        j["max_steps"] = 5  # 5 steps in chunks of 2: the last chunk is short
    # by default plans that do not depend on time (greedy), so planning is deterministic on a loaded machine
    cfg = load_run_config(write_run(tmp_path, jobs, out=out), list(overrides))
    tokenizer, state = load_jobs(cfg)
    return Feed(state, resolve(cfg, World.for_plan(cfg), None).scheduler, dp_rank=0, eos_id=tokenizer.eos_id,
                background=background)


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

    def broken(specs, config, fill=()):
        raise PlanError("planner broke")

    monkeypatch.setattr(feed_mod, "plan", broken)
    with pytest.raises(PlanError, match="planner broke"):
        _feed(tmp_path, True, "d").next()


def test_shortest_first_chunks_train_the_least_work_first_and_fill_its_idle_slots(tmp_path):
    """``scheduler.policy=shortest_first`` at pp=2: each chunk's main job is the running job with the fewest
    tokens left (its ``lookahead_batches`` batches), the others fill the slot left idle between its two
    batches; over the run every job's batches are drawn once, in order; the plans verify (in the feed)."""
    feed = _feed(tmp_path, False, "sf",
                 overrides=("scheduler.solver=greedy", "scheduler.policy=shortest_first",
                            "parallelism.pp=2"))
    drawn = {name: 0 for name in feed.jobs}
    mains, filled = [], 0
    while True:
        left = {n: feed._remaining_tokens(n) for n in feed.jobs if not feed.jobs[n].stream.finished}
        chunk = feed.next()
        if chunk is None:
            break
        main = min(left, key=lambda n: (left[n], list(feed.jobs).index(n)))
        mains.append(main)
        assert len(chunk.batches[main]) == min(2, 5 - drawn[main])
        others = set(chunk.batches) - {main}
        if len(chunk.batches[main]) == 2 and len(left) > 1:  # one idle slot between its two batches: filled
            last_main = max(mb.slot for mb in chunk.plan.microbatches if main in mb.jobs)
            assert others and not any(mb.is_noop for mb in chunk.plan.microbatches if mb.slot < last_main)
            filled += 1
        for name, batches in chunk.batches.items():
            assert [b for b, _ in batches] == list(range(drawn[name], drawn[name] + len(batches)))
            drawn[name] += len(batches)
    assert drawn == {"rev": 5, "up": 5, "rev2": 5} and filled >= 1
    assert mains[0] == "up"  # 5 steps × 3 samples: the least work
