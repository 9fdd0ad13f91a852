"""The job registry (runtime/jobs.py, rundir/states.py): transitions as methods, illegal ones refused; the
shown state derived in one place; the trainer's loop observed through callbacks."""

import threading
from types import SimpleNamespace

import pytest

from lorafusion.rundir.states import ENDED, LIVE, JobStatus, final_state, shown_state
from lorafusion.runtime.jobs import TRANSITIONS, JobState
from runtime_utils import job_dict, train_inprocess, write_dataset, write_run


def _job(status=JobStatus.RUNNING, steps=0, total=4) -> JobState:
    cfg = SimpleNamespace(name="a", max_nonfinite_steps=2)
    js = JobState(cfg, [], SimpleNamespace(total_steps=total),
                  optimizer=SimpleNamespace(paused=False), steps=steps)
    js.status = status
    return js


def test_the_states_are_design_s_list():
    assert [s.value for s in JobStatus] == ["queued", "running", "waiting", "saving", "done", "early_stopped",
                                            "cancelling", "cancelled", "diverged", "stopped"]
    assert ENDED == {"done", "cancelled", "diverged", "early_stopped"}
    assert LIVE == {"running", "waiting", "cancelling", "saving"}


def test_transitions_and_illegal_ones():
    js = _job(JobStatus.QUEUED)
    js.admit()
    assert js.status == JobStatus.RUNNING
    js.begin_cancel()
    assert js.status == JobStatus.CANCELLING
    js.cancel()
    assert js.status == JobStatus.CANCELLED and js.ended
    with pytest.raises(RuntimeError, match="cannot admit a job that is cancelled"):
        js.admit()
    js = _job()
    js.halt(JobStatus.DIVERGED)
    assert js.halted and js.optimizer.paused and js.final_status == JobStatus.DIVERGED
    with pytest.raises(RuntimeError, match="cannot halt"):
        js.halt(JobStatus.EARLY_STOPPED)
    with pytest.raises(ValueError):
        _job().halt(JobStatus.CANCELLED)
    js = _job()
    js.restore("early_stopped", 1)
    assert js.status is JobStatus.EARLY_STOPPED and js.optimizer.paused and js.nonfinite == 1


def test_a_transition_waits_for_the_planner_s_read():
    js, done = _job(JobStatus.QUEUED), threading.Event()
    with TRANSITIONS:  # the planning thread reading the statuses
        t = threading.Thread(target=lambda: (js.admit(), done.set()))
        t.start()
        assert not done.wait(0.2) and js.status == JobStatus.QUEUED
    t.join(5)
    assert js.status == JobStatus.RUNNING


def test_record_step_and_divergence():
    js = _job()
    assert js.record_step({"tokens": 5, "loss": 2.0, "grad_norm": 1.0}) == (True, False)
    assert js.record_step({"tokens": 5, "loss": float("nan"), "grad_norm": float("inf")}) == (False, True)
    assert js.record_step({"tokens": 5, "loss": float("inf"), "grad_norm": 1.0}) == (False, False)
    assert (js.steps, js.tokens, js.last_loss, js.first_loss, js.nonfinite) == (3, 15, 2.0, 2.0, 2)
    assert js.diverging


@pytest.mark.parametrize("status,kw,shown", [
    ("running", {}, "running"),
    ("running", {"in_chunk": False}, "waiting"),
    ("running", {"run_stopped": True}, "stopped"),
    ("running", {"finished": True}, "running"),
    ("running", {"finished": True, "handed_over": True}, "saving"),
    ("running", {"finished": True, "handed_over": True, "written": True}, "done"),
    ("cancelling", {"in_chunk": False}, "cancelling"),
    ("diverged", {"handed_over": True}, "diverged"),
    ("queued", {"run_stopped": True}, "queued"),
])
def test_shown_state(status, kw, shown):
    args = {"finished": False, "handed_over": False, "written": False, "run_stopped": False,
            "in_chunk": None} | kw
    assert shown_state(status, **args) == shown


def test_final_state():
    assert final_state("running", finished=True) == "done"
    assert final_state("running", finished=False) == "stopped"
    assert final_state("cancelling", finished=False) == "stopped"
    for s in ("queued", "cancelled", "diverged", "early_stopped"):
        assert final_state(s, finished=False) == s


def test_the_loop_is_observed_through_callbacks(tmp_path, megatron_single):
    class Seen:
        def __init__(self):
            self.events = []

        def chunk_start(self, trainer, chunk):
            self.events.append(("start", sorted(chunk.batches)))

        def chunk_ran(self, trainer, chunk, result):
            self.events.append(("ran", len(result["steps"])))

        def chunk_end(self, trainer, chunk, record):
            self.events.append(("end", record["bubble"], record["result"] is not None))

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), 4, steps=4, gbs=4)])
    seen = Seen()
    summary, _ = train_inprocess(run, ["scheduler.lookahead_batches=2"], callbacks=[seen])
    assert summary["windows"] == 2
    assert seen.events == [("start", ["a"]), ("ran", 2), ("end", None, True)] * 2
