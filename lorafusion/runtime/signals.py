"""Stop requests: SIGTERM, SIGUSR1 (Slurm's warning before a time limit or preemption) and SIGINT ask the
run to stop at the next chunk boundary — the microbatches in flight finish, every job is checkpointed, the
process exits 0. A second SIGINT stops at once (KeyboardInterrupt). While the run is still being set up (data,
distributed start, model build, checkpoint load: nothing trained yet, nothing to checkpoint) a stop ends the
process at once: SIGTERM / SIGUSR1 with status 0, SIGINT as a KeyboardInterrupt.

Ranks agree through :meth:`StopSignals.poll` (one small all-reduce per chunk, every rank calls it), so a
signal that reached only some ranks still stops all of them at the same chunk boundary.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """Context manager installing the handlers (main thread only; elsewhere it is inert)."""

    def __init__(self):
        self.received: str | None = None  # name of the first stop signal
        # False while the run is set up: a stop exits at once; True once it can checkpoint (see :meth:`defer`)
        self.deferring = False
        self._previous: dict = {}

    def defer(self) -> None:
        """From now on a stop is taken at the next chunk boundary (the run is set up: it can checkpoint)."""
        self.deferring = True

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if not self.deferring:  # setting up (a model build takes minutes): nothing to checkpoint, stop now
            print(
                f"lorafusion: stopped by {signal.Signals(signum).name} while starting (nothing trained yet)",
                  file=sys.stderr)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(0)
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        if self.received is None:
            self.received = signal.Signals(signum).name

    def poll(self, *flags: bool) -> list[bool]:
        """``[stop requested on any rank, *flags or-ed over all ranks]`` (collective when distributed)."""
        # (torch imported here: every command installs the stack dump below, and submit / cancel / status need
        # no torch — they start beside a busy run)
        import torch
        import torch.distributed as dist

        from lorafusion.dist import multi_process

        local = [self.received is not None, *flags]
        if not multi_process():
            return local
        t = torch.tensor([int(x) for x in local], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]


def exit_on_stop_outside_run() -> None:
    """SIGTERM and SIGUSR1 before a run's :class:`StopSignals` take over (start-up: nothing trained yet) and
    after they are gone (the run has ended, its summary is written) end the process with status 0, like a stop
    during the run (the default action would be 143). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame):
        if _hold["on"]:  # inside stops_held (delivered via another thread): taken when it ends
            _hold["pending"] = True
            return
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, stop)


_hold = {"on": False}  # inside stops_held: a stop is recorded ("pending") and taken when the block ends


@contextlib.contextmanager
def stops_held():
    """SIGTERM and SIGUSR1 held back (blocked, kept pending) inside the block and delivered when it ends: a
    stop that lands while torch is being imported would raise SystemExit inside its C++ initialisation, and
    the half-initialised torch aborted the process at exit (status -6) instead of exiting 0. Main thread
    only."""
    held = {signal.SIGTERM, signal.SIGUSR1}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # the mask holds the signal back from this thread only: one delivered to another thread still runs the
    # handler here, between two bytecodes of the import, so the handler itself defers while _hold is on
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    _hold["on"] = True
    try:
        yield
    finally:
        _hold["on"] = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    if _hold.pop("pending", False):
        raise SystemExit(0)


def install_stack_dump(sig: int = signal.SIGUSR2) -> None:
    """``kill -USR2 <pid>`` prints every thread's Python stack to stderr and the run goes on: what a user (or
    ``scripts/device/watch.sh``) needs to see where a distributed run waits. Main thread only; idempotent."""
    if threading.current_thread() is not threading.main_thread():
        return
    # the process's own stderr (a caller may have replaced sys.stderr with an object that has no file)
    stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    try:
        faulthandler.register(sig, file=stream, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # no file descriptor to write to: nothing to install
        pass
