"""Writing what ended jobs leave behind while the other jobs train.

A job that ends in a run that goes on (runtime/admission.py) is captured at a chunk boundary in host memory —
collective and quick — and its final checkpoint and PEFT adapter are then written by one background thread
per process, in order, while the next chunks run. A job's ``on_done`` runs once all its files are complete
(``status`` says ``done`` from then on). The first failed write is raised on the main thread at the next
:meth:`Handover.check` (each chunk boundary) or at :meth:`Handover.flush` (the end of the run, which waits
for every write: a run never exits with a hand-over half-written).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Handover:
    """One writer thread (started at the first :meth:`submit`); writes run in submission order."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, write: Callable[[], object], on_done: Callable[[], None] = lambda: None) -> None:
        """Run ``write()`` (no collectives) in the background, then ``on_done()``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafusion-handover")

        def task() -> None:
            write()
            on_done()

        self._pending.append(self._pool.submit(task))

    @property
    def pending(self) -> int:
        """Writes not finished yet."""
        return sum(not f.done() for f in self._pending)

    def check(self) -> None:
        """Raise the error of a finished write, if one failed; forget the finished ones."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()

    def flush(self) -> None:
        """Wait for every write; raise the first error (after all have ended)."""
        pending, self._pending = self._pending, []
        errors = [e for f in pending if (e := f.exception()) is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Flush, then stop the thread."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
