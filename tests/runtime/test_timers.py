"""Stage timers: CUDA events recorded without host synchronisation, resolved when the totals are read."""

import time

import pytest
import torch

from lorafusion.runtime.telemetry import timers as timers_mod
from lorafusion.runtime.telemetry.timers import StageTimers


def test_cpu_spans_and_bubble(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 3.0, 3.5, 4.0, 0.0, 10.0])
    monkeypatch.setattr(timers_mod.time, "perf_counter", lambda: next(clock))
    t = StageTimers(cuda=False)
    t("forward-compute").start()
    t("forward-compute").stop()  # 1.0
    t("backward-compute").start()
    t("backward-compute").stop()  # 2.0
    t("forward-compute").start()
    t("forward-compute").stop()  # 0.5
    t("forward-backward").start()
    t("forward-backward").stop()  # 10.0
    t("p2p").stop()  # a stop without a start is ignored
    totals = t.reset()
    assert totals == {"forward-compute": 1.5, "backward-compute": 2.0, "forward-backward": 10.0}
    assert StageTimers.bubble(totals) == pytest.approx(1 - 3.5 / 10)
    assert t.reset() == {} and StageTimers.bubble({}) is None


class _FakeEvent:
    """Stands in for torch.cuda.Event: record() reads a fake GPU clock (ms)."""

    gpu_ms = 0.0
    created = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        _FakeEvent.created += 1
        self.t = None

    def record(self):
        self.t = _FakeEvent.gpu_ms

    def elapsed_time(self, end):
        assert self.t is not None and end.t is not None
        return end.t - self.t


def test_cuda_marks_never_synchronise_and_totals_resolve_at_reset(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    t = StageTimers(cuda=True)
    for _ in range(3):  # three microbatches: forward 4 ms, backward 6 ms, with 1 ms gaps
        t("forward-compute").start()
        _FakeEvent.gpu_ms += 4
        t("forward-compute").stop()
        _FakeEvent.gpu_ms += 1
        t("backward-compute").start()
        _FakeEvent.gpu_ms += 6
        t("backward-compute").stop()
        _FakeEvent.gpu_ms += 1
    assert syncs == []  # the hot path never waits for the GPU
    totals = t.reset()
    assert syncs == [1]
    assert totals == pytest.approx({"forward-compute": 0.012, "backward-compute": 0.018})
    created = _FakeEvent.created
    t("forward-compute").start()
    t("forward-compute").stop()
    assert _FakeEvent.created == created  # events are reused after reset


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_event_spans_match_synchronised_wall_time():
    x = torch.randn(4096, 4096, device="cuda")
    t = StageTimers()
    assert t.cuda
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    t("forward-compute").start()
    for _ in range(20):
        x = torch.tanh(x @ x * 1e-3)
    t("forward-compute").stop()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy = t.reset()["forward-compute"]
    assert 0.5 * wall < busy <= wall * 1.05, (busy, wall)


def test_paused_timers_record_nothing(monkeypatch):
    """An evaluation runs Megatron's schedule with the run's timers paused (not swapped out of the config)."""
    clock = iter([0.0, 1.0, 5.0, 7.0])
    monkeypatch.setattr(timers_mod.time, "perf_counter", lambda: next(clock))
    t = StageTimers(cuda=False)
    with t.paused() as same:
        assert same is t
        t("forward-compute").start()
        t("forward-compute").stop()  # the clock is not even read
    assert t.reset() == {}
    t("forward-compute").start()
    t("forward-compute").stop()
    assert t.reset() == {"forward-compute": 1.0}
