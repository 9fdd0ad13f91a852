"""A run's output directory: whether a fresh run may use it, and one run at a time (a lock). (No torch here:
``lorafusion submit``, ``cancel`` and ``status`` import this beside a busy run, and must start quickly.)"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

from lorafusion.core.errors import ConfigError
from lorafusion.rundir.layout import RunDir


def check_output_dir(out: Path, source, *, resume: bool) -> None:
    """A fresh run refuses a directory that already holds a run's checkpoints, adapters or summary."""
    try:
        if resume or not out.exists():
            return
    except OSError as e:  # a name over NAME_MAX, a path through a file, ...
        raise ConfigError(f"{source}: output_dir: cannot use {out} ({e.strerror or e})") from None
    # what a failed run leaves before its first checkpoint (metrics rows, tensorboard, the lock) holds nothing
    # to keep: such a directory may be trained again from scratch
    taken = [n for n in ("checkpoints", "adapters", "summary.json")
             if (out / n).exists() and not ((out / n).is_dir() and not any((out / n).iterdir()))]
    if taken:
        raise ConfigError(f"{source}: output_dir: {out} already holds a run ({', '.join(taken)}); "
                          f"choose another output_dir or resume it with --resume")
    # anything else must be what a run (or `plan`, `export --base`) writes there, in a directory a run has
    # held (a run takes .lock before it writes): a user's own metrics.jsonl or notes are never replaced
    names = {p.name for p in out.iterdir()}
    foreign = sorted(n for n in names - RUN_NAMES if not (n.startswith(".") and ".tmp" in n))
    if not foreign and ".lock" not in names and names - {"plan"}:
        foreign = sorted(names - {"plan"})
    if foreign:
        raise ConfigError(f"{source}: output_dir: {out} holds files that are not a lorafusion run's "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose a new or "
                          f"empty directory")


# what a run, `lorafusion plan` (plan/) and `export --base` (base/) write in an output_dir
RUN_NAMES = {".lock", "metrics.jsonl", "tensorboard", "status.json", "summary.json", "requests", "submitted",
             "base_model.json", "run_config.json", "checkpoints", "adapters", "plan", "base",
             "wandb", "mlruns"}


class OutputDirLock:
    """One run per output_dir: global rank 0 holds an exclusive ``flock`` on ``OUTPUT_DIR/.lock`` until
    :meth:`release` or the end of the process (the OS releases it even after a crash)."""

    def __init__(self, out: Path, source):
        self.out = out
        self.source = source
        self.owned = False  # this process holds the lock (so may clean the directory up after a failure)
        self._file = None

    def acquire(self, is_logger: bool, share: Callable[[str], str] = lambda holder: holder) -> None:
        """Collective: rank 0 (``is_logger``) takes the lock; every rank raises if another run holds it.
        ``share``: rank 0's value on every rank (``lorafusion.dist.share_from_rank0`` in a multi-process
        run)."""
        import fcntl
        import os

        holder = ""
        if is_logger:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                path = RunDir(self.out).lock
                self._file = path.open("a+")
            except OSError as e:  # e.g. /proc/self/x, a file on the way, a read-only disk: said on every rank
                from lorafusion.rundir.atomic import blocker

                # (a dangling symlink: "File exists")
                why = blocker(self.out) if e.errno == errno.EEXIST else None
                holder = f"!cannot create {e.filename or self.out} ({why or e.strerror or e})"
        if is_logger and self._file is not None:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.owned = True
                self._file.seek(0)
                self._file.truncate()
                self._file.write(f"{os.getpid()}\n")
                self._file.flush()
            except BlockingIOError:
                self._file.seek(0)
                holder = self._file.read().strip() or "?"
                self._file.close()
                self._file = None
        holder = share(holder)
        if holder.startswith("!"):
            raise ConfigError(f"{self.source}: output_dir: {holder[1:]}; choose a directory you can "
                              f"write")
        if holder:
            raise ConfigError(f"{self.source}: output_dir: {self.out} is in use by another lorafusion train "
                              f"(pid {holder}); wait for it to end or choose another output_dir")

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def lock_held(out: Path) -> bool:
    """Whether a process (a ``lorafusion train``) holds ``out``'s lock now (a probe: taken and released at
    once)."""
    import fcntl

    path = RunDir(out).lock
    if not path.is_file():
        return False
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False
