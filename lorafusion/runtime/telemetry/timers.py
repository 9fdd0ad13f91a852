"""Stage timers plugged into Megatron's schedules (``config.timers``) to measure busy time per stage.

Megatron calls ``config.timers(name, log_level=...).start()/stop()`` around forward-compute,
backward-compute, p2p and the whole forward-backward. The bubble ratio of a stage over a chunk is
``1 - (forward-compute + backward-compute) / forward-backward``.

On CUDA, start and stop record CUDA events on the current stream and never synchronise, so the host can
run ahead of the GPU; the spans are resolved (one synchronisation) only when the totals are read with
:meth:`StageTimers.reset`, at the end of a chunk. A span is the GPU-stream time between the two marks,
the same quantity a host timer bracketed by ``torch.cuda.synchronize()`` measured. On CPU the marks are
``time.perf_counter()`` readings.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class _Timer:
    def __init__(self, owner: StageTimers, name: str):
        self.owner, self.name, self._start = owner, name, None

    def start(self, barrier: bool = False):
        self._start = self.owner._mark()

    def stop(self, barrier: bool = False):
        if self._start is None:
            return
        self.owner._spans[self.name].append((self._start, self.owner._mark()))
        self._start = None


class _Idle:
    """The timer handed out while the stage timers are paused: records nothing."""

    def start(self, barrier: bool = False):
        pass

    def stop(self, barrier: bool = False):
        pass


_IDLE = _Idle()


class StageTimers:
    """Megatron's ``config.timers`` for a training run: given to the model when it is built and kept for the
    run; :meth:`paused` stops it recording (an evaluation's forward passes are not training stage time)."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._paused = 0
        self._spans: dict[str, list[tuple]] = defaultdict(list)  # name -> [(start mark, stop mark)]
        self._timers: dict[str, _Timer] = {}
        self._free_events: list = []  # recorded events are reused after reset()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def paused(self):
        """Inside the block every timer Megatron asks for records nothing."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    def __call__(self, name: str, log_level: int = 0) -> _Timer | _Idle:
        if self._paused:
            return _IDLE
        if name not in self._timers:
            self._timers[name] = _Timer(self, name)
        return self._timers[name]

    def reset(self) -> dict[str, float]:
        """Seconds per timer name since the last reset (on CUDA this waits for the recorded work)."""
        totals: dict[str, float] = {}
        if self.cuda and self._spans:
            torch.cuda.synchronize()
        for name, spans in self._spans.items():
            if self.cuda:
                totals[name] = sum(a.elapsed_time(b) for a, b in spans) / 1000.0
                self._free_events.extend(e for span in spans for e in span)
            else:
                totals[name] = sum(b - a for a, b in spans)
        self._spans.clear()
        return totals

    @staticmethod
    def bubble(totals: dict[str, float]) -> float | None:
        wall = totals.get("forward-backward", 0.0)
        if wall <= 0:
            return None
        busy = totals.get("forward-compute", 0.0) + totals.get("backward-compute", 0.0)
        return max(0.0, 1.0 - busy / wall)
