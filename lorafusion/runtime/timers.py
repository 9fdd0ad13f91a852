"""Stage timers plugged into Megatron's schedules (``config.timers``) to measure busy time per stage.

Megatron calls ``config.timers(name, log_level=...).start()/stop()`` around forward-compute,
backward-compute, p2p and the whole forward-backward. The bubble ratio of a stage over a window is
``1 - (forward-compute + backward-compute) / forward-backward``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class _Timer:
    def __init__(self, owner: "StageTimers", name: str):
        self.owner, self.name, self._t0 = owner, name, None

    def start(self, barrier: bool = False):
        self.owner._sync()
        self._t0 = time.perf_counter()

    def stop(self, barrier: bool = False):
        if self._t0 is None:
            return
        self.owner._sync()
        self.owner.totals[self.name] += time.perf_counter() - self._t0
        self._t0 = None


class StageTimers:
    def __init__(self, synchronize: bool | None = None):
        self.totals: dict[str, float] = defaultdict(float)
        self._timers: dict[str, _Timer] = {}
        self.synchronize = torch.cuda.is_available() if synchronize is None else synchronize

    def _sync(self):
        if self.synchronize:
            torch.cuda.synchronize()

    def __call__(self, name: str, log_level: int = 0) -> _Timer:
        if name not in self._timers:
            self._timers[name] = _Timer(self, name)
        return self._timers[name]

    def reset(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out

    @staticmethod
    def bubble(totals: dict[str, float]) -> float | None:
        wall = totals.get("forward-backward", 0.0)
        if wall <= 0:
            return None
        busy = totals.get("forward-compute", 0.0) + totals.get("backward-compute", 0.0)
        return max(0.0, 1.0 - busy / wall)
