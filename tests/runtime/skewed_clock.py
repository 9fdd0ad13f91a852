"""``python tests/runtime/skewed_clock.py train RUN.yaml [--serve]``: ``lorafusion train`` through
sync_guard.py (the PP synchronise guard), with the trainer's clock of global rank 1 running at half speed, and
a serving run looking for submissions every 0.05 s instead of every 2 s.

A decision that each rank takes on its own clock (the serving idle timeout) then differs between the ranks:
one leaves the loop while the other waits in the next collective, and the run hangs instead of ending.
Decisions the ranks agree on (through ``StopSignals.poll``) are unaffected."""

import os
import sys
import time

import sync_guard  # noqa: F401 - installs the guard (and the CPU patches)
from lorafusion.runtime import trainer


class _HalfSpeed:
    """The ``time`` module, except ``monotonic``: half as fast from now on."""

    def __init__(self):
        self._t0 = time.monotonic()

    def monotonic(self) -> float:
        return self._t0 + (time.monotonic() - self._t0) / 2

    def __getattr__(self, name):
        return getattr(time, name)


trainer.Trainer.SERVE_POLL_S = 0.05
if os.environ.get("RANK") == "1":
    trainer.time = _HalfSpeed()

if __name__ == "__main__":
    from lorafusion.cli import main

    sys.exit(main())
