"""megatron_patches.trace: with LORAFUSION_PIPELINE_TRACE set, a run records where it is in the schedule (its
forward and backward steps with Megatron's microbatch, the optimizer steps, the schedule's bounds), one line
per event in order; unset, nothing is written and the schedule's functions are Megatron's own."""

import pytest

from runtime_utils import three_job_dicts, train_inprocess, write_run


@pytest.fixture
def trace_module():
    from megatron_patches import trace

    yield trace
    if trace._file is not None:
        trace._file.close()
    trace._file, trace._count = None, 0


def test_a_run_records_its_schedule_positions(tmp_path, megatron_single, monkeypatch, trace_module):
    prefix = tmp_path / "trace"
    monkeypatch.setenv(trace_module.ENV, str(prefix))
    train_inprocess(write_run(tmp_path, three_job_dicts(tmp_path), capacity=160))
    lines = (tmp_path / "trace.rank0").read_text().splitlines()
    events = [line.split(" ", 2)[2] for line in lines]
    assert [int(line.split()[0]) for line in lines] == list(range(1, len(lines) + 1))
    assert events[0].startswith("schedule begin: ") and "schedule end" in events
    first = events.index("F begin mb=0 chunk=None")
    assert events[first + 1].startswith("forward chunk=0 tokens=")
    assert events[first + 2] == "F end mb=0 chunk=None"
    assert events.count("B begin") == events.count("B end") == sum(e.startswith("F begin") for e in events)
    assert any(e.startswith("optimizer step begins ('rev', 0)") for e in events)
    assert any(e.startswith("optimizer step ends ('rev', 0)") for e in events)


def test_off_by_default(tmp_path, megatron_single, monkeypatch, trace_module):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.delenv(trace_module.ENV, raising=False)
    fwd = schedules.forward_step
    with trace_module.traced_schedule():
        assert schedules.forward_step is fwd
    trace_module.record("x")
    assert trace_module._file is None
